"""The stage protocol every stage implements (docs/architecture.md, "The stage contract").

A stage is a `Stage` subclass with a name, a version, a typed `Params` dataclass and a `run` that takes exactly
what it uses: `run(params, inputs, store)`, plus `map_shards` for the stages whose work splits into shards
(`maps_shards = True`, so a flow knows what to pass without inspecting signatures). The output's key is derived
in one place, `key`, from two hooks a stage may override: `key_params` (what of the params changes the output)
and `key_inputs` (the fingerprints of what it reads); `build_artifact` commits under that same key, so `key`
always names what `run` builds. The key also covers the stage's code: the import closure of its module (and of
what else `code_modules` names, such as the pretrain stage's `torchrun` entry point) and the versions of its
`libraries` (`storage.code_fingerprint`). Each stage module keeps module-level `run` and `key` (its stage's
methods) for plain calls such as `stages.clean.run(params, [raw], store)`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter, run_stage, stage_key
from storage.code_fingerprint import describe_code

Inputs = Sequence[ArtifactRef | str]


class Stage:
    """One pipeline stage: subclasses set `name`, `version`, `Params` and implement `run`."""

    name: ClassVar[str]
    version: ClassVar[str]
    Params: ClassVar[type]
    maps_shards: ClassVar[bool] = False  # True: `run` takes `map_shards` (one call per shard of its work)
    libraries: ClassVar[tuple[str, ...]] = ()  # distributions whose versions shape the output (enter the key)

    def params_from_dict(self, values: dict[str, Any]) -> Any:
        """Typed params from the plain dict a Prefect task receives (`dataclasses.asdict` of them, through
        JSON): a list given for a field whose default is a tuple becomes a tuple again, so equal settings
        give equal params."""
        tuple_fields = {f.name for f in dataclasses.fields(self.Params) if isinstance(f.default, tuple)}
        return self.Params(
            **{name: _as_tuple(value) if name in tuple_fields else value for name, value in values.items()}
        )

    def key_params(self, params: Any) -> Any:
        """What of the params enters the key and the manifest (all of them unless a stage says otherwise)."""
        return params

    def key_inputs(self, params: Any, inputs: Inputs) -> list[ArtifactRef | str]:
        """The inputs' fingerprints for the key: upstream artifacts, or descriptions of external sources."""
        return list(inputs)

    def code_modules(self, params: Any) -> tuple[str, ...]:
        """The modules whose import closures are the code that builds the artifact: the stage's own module."""
        module = type(self).__module__
        if module == "__main__":  # `python -m stages.tokenize`: the module's own name
            module = sys.modules["__main__"].__spec__.name
        return (module,)

    def code(self, params: Any) -> dict[str, Any]:
        """The code that builds the artifact (`storage.code_fingerprint.describe_code`): the key covers it."""
        return describe_code(self.code_modules(params), self.libraries)

    def keys(self, params: Any, inputs: Inputs) -> tuple[str, str]:
        """(the output's key, as `run` computes it, without running; its base key, without the code)."""
        key_params, key_inputs = self.key_params(params), self.key_inputs(params, inputs)
        code = self.code(params)["fingerprint"]
        return (
            stage_key(self.name, self.version, key_params, key_inputs, code),
            stage_key(self.name, self.version, key_params, key_inputs),
        )

    def key(self, params: Any, inputs: Inputs) -> str:
        """The output's key, as `run` computes it, without running."""
        return self.keys(params, inputs)[0]

    def build_artifact(
        self, params: Any, inputs: Inputs, store: ArtifactStore, build: Callable[[ArtifactWriter], dict]
    ) -> ArtifactRef:
        """The committed artifact of `key(params, inputs)`: found at once, or, after checking every input
        artifact against its manifest, built by `build` and committed."""
        items = [inputs] if isinstance(inputs, str | ArtifactRef) else inputs
        uses = [item for item in items if isinstance(item, ArtifactRef)]
        return run_stage(
            store,
            self.name,
            self.version,
            self.key_params(params),
            self.key_inputs(params, inputs),
            build,
            code=self.code(params),
            uses=uses,
        )

    def run(self, params: Any, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Build (or find) the artifact of `params` and `inputs`; shard-mapping stages also take `map_shards`."""
        raise NotImplementedError


def _as_tuple(value: Any) -> Any:
    """Lists, nested too, as tuples."""
    return tuple(_as_tuple(item) for item in value) if isinstance(value, list | tuple) else value


def expect_inputs(stage: Stage, inputs: Inputs, count: int, what: str) -> list:
    """The stage's `count` inputs, or a ValueError naming what the stage takes."""
    if len(inputs) != count:
        raise ValueError(f"the {stage.name} stage takes {what}, got {list(inputs)!r}")
    return list(inputs)
