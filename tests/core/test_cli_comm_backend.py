"""``titan run --comm-backend ""`` (an unset shell variable, ``--comm-backend "$MODE"``) ran the
recipe's backend, a real job, where the user asked for another one: refused like an empty
``--dump-folder``."""

from __future__ import annotations

from tests.conftest import run_titan


def test_an_empty_comm_backend_is_refused_not_ignored() -> None:
    for flag in (["--comm-backend", ""], ["--comm-backend=  "]):
        result = run_titan("run", "--recipe", "llama3_debugmodel", *flag, "--print-config")
        assert result.returncode == 2, result.stdout[-500:]
        assert result.stderr.startswith("titan: error: --comm-backend: got an empty name"), result.stderr
        assert result.stdout.count("[comm]") == 0
