"""Measuring: timers, statistics, bytes on the wire, what collectives move and cost (``costs``),
floors (``limits``), memory and start-up phases. Nothing here knows a strategy or a trainer."""
