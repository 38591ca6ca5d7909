"""The models users train: a Hugging Face transformers architecture built from its config
(``--model hf:CONFIG``), with seeded random weights, on the zoo's seeded token data.

CONFIG is a ``config.json`` (what every downloaded model has) or the name of one that ps_bench
ships in ``configs/hf/`` with the published sizes of a real architecture. Nothing is downloaded:
``AutoModelForCausalLM.from_config`` (``AutoModelForSeq2SeqLM`` for an encoder-decoder such as
T5) builds the architecture, initialised from ``--torch-seed``, and trains it with the causal
language-model loss on ``SyntheticTokens`` (each position's target is the next token; with
``--target-loss`` the teacher's sequences). ``--model-option KEY=VALUE`` changes the config
(shrinking a model this machine cannot hold), and the run's results keep the config it used.
ps_bench trains in float32 and without dropout (as the zoo's transformer), so that strategies
can be held against each other parameter for parameter: the config's dropout probabilities are
set to 0 unless a ``--model-option`` sets them, and its ``torch_dtype`` is dropped.

transformers is an optional package (``pip install -e ".[hf]"``); it is imported only where a run
or a prediction asks for an ``hf:`` model. An encoder-decoder reads the sequence in its encoder
and predicts it one token ahead in its decoder (teacher forcing). Hugging Face models have no
sparse gradients: the strategies made for sparse embeddings are refused on them.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from ps_bench.config import PROJECT_ROOT, ConfigError, read_json
from ps_bench.models.base import MODELS, BenchmarkModel, SyntheticData
from ps_bench.models.entries import Entry
from ps_bench.models.transformer import TOKENS

PREFIX = "hf:"
SHIPPED = PROJECT_ROOT / "configs" / "hf"
INSTALL = 'pip install -e ".[hf]"'
DEFAULT_DATA = "tokens64"  # 512 teacher sequences of 64 tokens over a 512-token vocabulary
DROPPED = ("torch_dtype", "dtype")  # ps_bench trains in float32
CLASS_NAME = "HuggingFace"


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def shipped() -> list[str]:
    """The names of the configs ps_bench ships (``configs/hf/NAME.json``)."""
    return sorted(path.stem for path in SHIPPED.glob("*.json"))


def transformers() -> Any:
    """The transformers package, or a ConfigError saying how to install it."""
    try:
        library = importlib.import_module("transformers")
    except ImportError:
        raise ConfigError(f"--model {PREFIX}...: Hugging Face models need the transformers "
                          f"package: {INSTALL}") from None
    # its advice on configs (token ids outside a shrunk vocabulary, generation settings) is for
    # text generation, which a benchmark of the training step never does
    library.logging.set_verbosity_error()
    return library


def config_path(name: str) -> Path:
    """The file ``hf:NAME`` names: a path to a config.json, else a shipped config."""
    given = name[len(PREFIX):]
    candidate = Path(given)
    if candidate.is_file():
        return candidate
    if (SHIPPED / f"{given}.json").is_file():
        return SHIPPED / f"{given}.json"
    # a downloaded model's folder
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return candidate / "config.json"
    raise ConfigError(f"--model {name}: no config file {given!r} and no config of that name "
                      f"shipped in configs/hf (shipped: {', '.join(shipped())})")


def resolve(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The config ``name`` gives, as transformers completes it, with ps_bench's float32 and no
    dropout, and then ``options``; one line naming the input for anything wrong."""
    path = config_path(name)
    raw = read_json(path, f"--model {name}: config", own_format=False)
    if not isinstance(raw, dict):
        raise ConfigError(f"--model {name}: {str(path)!r} must hold a JSON object (a model's "
                          f"config.json)")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"--model {name}: {str(path)!r} has no \"model_type\", which names the "
                          f"architecture (llama, mistral, gpt2, t5, ...)")
    library = transformers()
    values = {key: value for key, value in raw.items()
              if key not in DROPPED and key != "model_type"}
    if model_type not in library.CONFIG_MAPPING:
        raise ConfigError(f"--model {name}: model_type {model_type!r} is not an architecture "
                          f"transformers {library.__version__} knows")
    try:
        known = library.AutoConfig.for_model(model_type, **values).to_dict()
    except Exception as error:  # noqa: BLE001 - whatever the config's own checks raise
        raise ConfigError(f"--model {name}: {str(path)!r}: {refusal(error)}") from None
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"--model-option {unknown[0]}: the {model_type} config has no such key; "
                          f"its keys: "
                          f"{', '.join(sorted(k for k in known if not k.startswith('_')))}")
    no_dropout = {key: 0.0 for key, value in known.items() if is_dropout(key, value)}
    try:
        config = library.AutoConfig.for_model(model_type, **{**values, **no_dropout, **options})
    except Exception as error:  # noqa: BLE001 - whatever the config's own checks raise
        raise ConfigError(f"--model-option: {refusal(error)}") from None
    return {key: value for key, value in config.to_diff_dict().items() if key not in DROPPED}


def refusal(error: BaseException) -> str:
    """What a config's checks said, in one line: transformers 5 validates a config's values
    (``The hidden size (100) is not a multiple of the number of attention heads (32).``) and
    huggingface_hub wraps that in an error of its own, which says only which check failed."""
    said = str(error.__cause__ or error).strip() or type(error).__name__
    return said.splitlines()[0]


def is_dropout(key: str, value: Any) -> bool:
    return isinstance(value, float) and ("dropout" in key or key.endswith("pdrop"))


def entry(name: str, options: dict[str, Any]) -> Entry:
    """The model entry of ``--model hf:CONFIG`` with ``--model-option``s: its resolved config."""
    return Entry(name, CLASS_NAME, {"config": resolve(name, options)}, str(config_path(name)))


@MODELS.register(CLASS_NAME)
class HuggingFaceModel(BenchmarkModel):
    """A transformers architecture from its config (``config``: a config dict with its
    ``model_type``), seeded random weights, float32; returns logits as CrossEntropyLoss takes
    them."""

    takes = TOKENS

    def __init__(self, config: dict) -> None:
        super().__init__()
        library = transformers()
        settings = {key: value for key, value in config.items() if key != "model_type"}
        built = library.AutoConfig.for_model(config["model_type"], **settings)
        self.seq2seq = bool(built.is_encoder_decoder)
        auto = library.AutoModelForSeq2SeqLM if self.seq2seq else library.AutoModelForCausalLM
        self.model = auto.from_config(built)
        self.vocab_size = built.vocab_size
        self.context_length = (getattr(built, "max_position_embeddings", None) or
                               getattr(built, "n_positions", None))

    def forward(self, tokens):
        if self.seq2seq:
            logits = self.model(input_ids=tokens, decoder_input_ids=tokens, use_cache=False).logits
        else:
            logits = self.model(input_ids=tokens, use_cache=False).logits
        return logits.transpose(1, 2)  # (batch, vocab, positions), as CrossEntropyLoss takes them

    def fits(self, data: SyntheticData) -> str | None:
        default = ("leave --data out: the default token data takes the model's vocabulary and "
                   "context")
        if data.vocab_size > self.vocab_size:
            return (f"draws tokens below vocab_size={data.vocab_size} but the model has "
                    f"{self.vocab_size} ({default})")
        if self.context_length and data.sequence_length > self.context_length:
            return (f"has sequences of {data.sequence_length} tokens but the model's context is "
                    f"{self.context_length} ({default})")
        return None

    def fitted_data(self, configurations: dict) -> dict:
        """The default token data over no more tokens than the model's vocabulary, in sequences
        no longer than its context."""
        fitted = {**configurations,
                  "vocab_size": min(configurations["vocab_size"], self.vocab_size)}
        if self.context_length:
            fitted["sequence_length"] = min(configurations["sequence_length"], self.context_length)
        return fitted

    def shard_units(self) -> list[nn.Module]:
        """The blocks FSDP2 wraps one by one, as torchtitan and accelerate wrap transformer
        blocks: the modules of the classes the model names unsplittable (its decoder or encoder
        layers); the embeddings, final norm and output stay with the root."""
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [module for module in self.model.modules() if type(module).__name__ in names]


@contextlib.contextmanager
def unpacked_on_meta(network: nn.Module) -> Iterator[None]:
    """Around a forward on the meta device: a Hugging Face causal mask looks for packed sequences
    in the position ids, a data-dependent check no meta tensor can answer (the data here is never
    packed): told there are none. Any other model: nothing to do."""
    if not isinstance(network, HuggingFaceModel):
        yield
        return
    from transformers import masking_utils  # a Hugging Face model: already imported

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
