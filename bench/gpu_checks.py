"""The runner of the GPU check scripts (``bench/gpu_perf_check.py``, ``bench/gpu_float8_check.py``):
one ``PASS``/``FAIL`` line per check, a failing check never hiding the others, exit 1 if any failed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

RESULTS: list[bool] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def run_checks(checks: Sequence[Callable[[], None]]) -> int:
    """Run each check (which calls :func:`report`); an exception is that check's FAIL line."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"torch {torch.__version__}, {device}", flush=True)
    for check in checks:
        try:
            check()
        except Exception as exc:  # one failing check must not hide the others
            report(check.__name__, False, f"{type(exc).__name__}: {str(exc)[:400]}")
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed", flush=True)
    return 0 if all(RESULTS) else 1
