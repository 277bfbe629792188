"""benchmarks/pool_handover.py: both pools run the same step and lowmem's is put back. Nothing is timed."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))


def test_pool_handover_times_both_pools_on_the_same_step(tmp_path):
    pytest.importorskip("threadpoolctl")
    import pool_handover
    from lowmem.system import threads
    before, ours = threads.threads(), threads.parallel_for
    out = tmp_path / "pool.json"
    try:
        pool_handover.main(["--depth", "8", "--batch", "4", "--rounds", "2", "--steps", "1", "--calls", "20",
                            "--json", str(out)])
    finally:
        threads.configure(before)
    got = json.loads(out.read_text())
    assert threads.parallel_for is ours                        # swapped back
    assert set(got["empty_call_s"]) == {"lowmem", "reference"} and all(v > 0 for v in got["empty_call_s"].values())
    assert len(got["rounds"]) == 2 and got["ratio_min"] <= got["ratio_median"] <= got["ratio_max"]
