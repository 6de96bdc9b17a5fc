"""Each process's tokenizer thread pool is its share of the host's cores: Rayon sizes the pool of
the ``tokenizers`` library to all of them, so 8 ranks on one host ran 8 times as many tokenizer
threads as cores next to training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Loads titan's tokenizer and encodes a batch (the pool starts there), in a fresh process: the
#: threads the pool added, the variable the library saw, and the cores the process may use.
_PROBE = """
import json, os
def threads():
    return len(os.listdir("/proc/self/task"))
from titan_core.data.loader import load_tokenizer
tok = load_tokenizer(None)
before = threads()
tok.encode_batch(["the rain falls on the valley %d" % i for i in range(4000)])
print(json.dumps({"pool": threads() - before, "rayon": os.environ.get("RAYON_NUM_THREADS"),
                  "cores": len(os.sched_getaffinity(0))}))
"""

_CLEAN = (
    "RAYON_NUM_THREADS",
    "RAYON_RS_NUM_CPUS",
    "TOKENIZERS_PARALLELISM",
    "LOCAL_WORLD_SIZE",
    "TITAN_RAYON_NUM_THREADS",
)


def _probe(**env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")


@pytest.mark.parametrize("local", [None, "1", "2", "64"])
def test_each_process_uses_its_share_of_the_cores(local: str | None) -> None:
    found = _probe(**({"LOCAL_WORLD_SIZE": local} if local else {}))
    share = max(1, int(found["cores"]) // int(local or 1))  # type: ignore[call-overload]
    assert found["rayon"] == str(share)
    assert found["pool"] == share


@pytest.mark.parametrize("name", ["RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS"])
def test_a_pool_size_the_user_set_is_kept(name: str) -> None:
    found = _probe(LOCAL_WORLD_SIZE="64", **{name: "3"})
    assert found["pool"] == 3
    assert found["rayon"] == ("3" if name == "RAYON_NUM_THREADS" else None)


def test_parallelism_the_user_turned_off_stays_off() -> None:
    assert _probe(LOCAL_WORLD_SIZE="1", TOKENIZERS_PARALLELISM="false")["pool"] == 0


def test_a_process_started_by_a_titan_process_sizes_its_own_pool() -> None:
    """A child inherits the parent's ``RAYON_NUM_THREADS``: titan's value is not the user's."""
    found = _probe(LOCAL_WORLD_SIZE="64", RAYON_NUM_THREADS="2", TITAN_RAYON_NUM_THREADS="2")
    assert found["rayon"] == "1" and found["pool"] == 1
