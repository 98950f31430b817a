"""App-level helpers that know every role: the checks `rolefleet up` and `rolefleet serve` run
before anything starts (`preflight.py`), and the tiny models the demo and the tests build
(`tiny_model.py`, `shapes.py`)."""
