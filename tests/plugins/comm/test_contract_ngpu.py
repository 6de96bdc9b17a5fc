"""``NGPU`` set but empty (``NGPU=$N`` with N unset) outside run_train.sh (which refuses it): the
fake backends said ``NGPU is not set``, sending the user to look for a variable they had set. One
error naming it as set but empty, as ``FAKE_PP_RANK``'s is."""

from __future__ import annotations

import pytest

from titan_core.errors import UsageError
from titan_plugins_comm.contract import hybrid_launch, pure_fake_launch


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("value", ["", "  "])
def test_a_set_but_empty_ngpu_is_one_error_naming_it(pp: int, value: str) -> None:
    for launch, env in (
        (pure_fake_launch, {"NGPU": value, "FAKE_PP_RANK": "0"}),
        (hybrid_launch, {"NGPU": value, "RANK": "0", "WORLD_SIZE": str(pp)}),
    ):
        with pytest.raises(UsageError) as info:
            launch(pp, env)
        message = str(info.value)
        assert message.startswith(f"NGPU is set but empty ({value!r}): "), message
        assert "is not set" not in message
        assert f"divisible by parallelism.pp={pp}" in message and "docs/debugging.md" in message


def test_an_unset_ngpu_is_still_named_unset() -> None:
    with pytest.raises(UsageError, match=r"^NGPU is not set: "):
        pure_fake_launch(1, {})
