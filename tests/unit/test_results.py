import json

from ps_bench.metrics.results import write_results


def test_results_are_never_overwritten(tmp_path):
    target = tmp_path / "out" / "run.json"
    first = write_results({"n": 1}, target)
    second = write_results({"n": 2}, target)
    third = write_results({"n": 3}, target)
    assert (first, second, third) == (target, target.with_name("run-1.json"), target.with_name("run-2.json"))
    assert [json.loads(p.read_text())["n"] for p in (first, second, third)] == [1, 2, 3]
    assert sorted(p.name for p in target.parent.iterdir()) == ["run-1.json", "run-2.json", "run.json"]
