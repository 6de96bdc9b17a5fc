"""The hooks a titan plugin implements.

A plugin is a module (or object) registered under the ``titan`` entry-point group::

    [project.entry-points.titan]
    my_model = "my_package.plugin"

Its hook implementations are plain functions decorated with :data:`titan_core.hookimpl`.
Every hook is called once per run, when the registry first needs its records, never from the
training loop. Each returns a list of typed records (:mod:`titan_core.records`); the registry
gathers them and rejects a name provided by two plugins.

Convention for plugin authors: keep heavy imports (torch, your model code) inside the hook
bodies or inside the callables a record carries. ``titan plugins list`` and ``titan --help``
import every plugin module and must stay fast, so a plugin module must not import torch at
module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from titan_core.records import (
        Callback,
        Checkpointer,
        Command,
        CommBackend,
        ConfigSection,
        Dataset,
        ModelSpec,
        Recipe,
        RunOption,
        Strategy,
    )

PROJECT_NAME = "titan"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def titan_models() -> list[ModelSpec]:
    """Return the model families this plugin provides.

    Called when a run or ``titan plugins list`` first needs the model registry. Each
    :class:`~titan_core.records.ModelSpec` names a family (``config.model.name``) and its
    flavors (``config.model.flavor``). Building a model must not happen here: the spec's
    ``build`` callable is invoked later, on the meta device.
    """


@hookspec
def titan_recipes() -> list[Recipe]:
    """Return the recipes this plugin provides.

    A recipe is a plain function returning a :class:`~titan_core.config.TrainerConfig`;
    ``titan run --recipe NAME`` selects it. Recipes in a user's module given with
    ``--module`` need no hook: every public function of that module is a recipe.
    """


@hookspec
def titan_strategies() -> list[Strategy]:
    """Return the parallelism strategies (or model transforms) this plugin provides.

    Called once when the trainer builds the model. The trainer applies, in ascending
    ``Strategy.order``, every strategy whose ``applies(config, parallel_dims)`` returns ``True`` (a
    bool: anything else fails the run naming the strategy).

    A strategy that cannot run some layouts, and can tell from the config, the parallel degrees,
    the model spec and the model's arguments alone, gives ``check(config, parallel_dims, spec,
    model_args) -> list[str]``: the problems (``"section.field: message"``, naming what to set;
    empty when there are none). It is called, only when the strategy applies, by
    ``run_train.sh`` before torchrun starts any process and by the trainer before the mesh and
    the model are built, so a refused layout is one error line, not a failure in every worker.
    An exception from it is one ``PluginError`` naming the strategy and its plugin::

        def check(config, parallel_dims, spec, model_args):
            if config.training.seq_len % 2:
                return [f"training.seq_len: {config.training.seq_len} is odd; halves needs it even"]
            return []

        Strategy("halves", 45, applies, apply, "split sequences", check=check)
    """


@hookspec
def titan_comm_backends() -> list[CommBackend]:
    """Return the communication backends this plugin provides.

    ``config.comm.backend`` (or ``--comm-backend``) selects one by name. Its ``init(config)``
    is called once at start-up and returns the run's :class:`~titan_core.topology.Topology`.
    The environment variables it alone reads go in ``env_vars``: set for a run of another
    backend, they stop it with one error before anything starts (it would ignore them)::

        CommBackend("sim", init_sim, "a simulated cluster", env_vars=("SIM_RANK",))

    Config values every run of it has go in ``sets`` (``{"debug.memory_report": True}``),
    applied before validation and ``--print-config``. A backend that cannot run under some
    launches gives ``launch_check(config, processes)``, called by ``run_train.sh`` (``NGPU``)
    before torchrun starts and by each process (``WORLD_SIZE``) before ``init``::

        CommBackend("sim", init_sim, "a simulated cluster", launch_check=refuse_torchrun)
    """


@hookspec
def titan_datasets() -> list[Dataset]:
    """Return the text datasets this plugin provides; ``config.data.dataset`` selects one.

    A dataset with ``held_out`` documents (:class:`~titan_core.records.Dataset`) is validated on
    those when validation reads the training data, so its validation loss is not on training text.
    """


@hookspec
def titan_checkpointers() -> list[Checkpointer]:
    """Return the checkpointers this plugin provides.

    The trainer builds the one named by ``config.checkpoint.backend`` when
    ``checkpoint.enable`` or ``checkpoint.create_seed_checkpoint`` is set, before the model; it
    loads before step 1 and saves the steps ``should_save`` names (see
    :class:`~titan_core.records.Checkpointer`). Its optional ``launch_check(config, processes)``
    runs earlier, before any process group starts (``run_train.sh`` calls it before torchrun)::

        Checkpointer("mine", build_mine, "my checkpoints", launch_check=refuse_seed_on_many)
    """


@hookspec
def titan_callbacks() -> list[Callback]:
    """Return callbacks run at fixed points of the training loop.

    Called once per run, after everything is built (model, optimizer, data, checkpoint loaded);
    each record's ``build(trainer)`` returns the object whose methods the loop calls, or ``None``
    when the callback is not wanted in this run (see :class:`~titan_core.records.Callback` for
    the methods). Example: print the loss every logging step::

        from titan_core import Callback, hookimpl

        class PrintLoss:
            def on_step_end(self, step, metrics, last):
                if "loss" in metrics:
                    print(step, metrics["loss"])

        @hookimpl
        def titan_callbacks():
            return [Callback("print_loss", lambda trainer: PrintLoss())]
    """


@hookspec
def titan_commands() -> list[Command]:
    """Return ``titan`` subcommands.

    Called when ``titan`` builds its argument parser (``titan --help`` lists every command), so
    ``configure`` must not import torch; ``run`` is called only for the chosen command.

    ``run(args)`` returns the exit status: an ``int`` from 0 to 255 (0: success) or ``None``
    (success); any other value is refused with one error naming the command and its plugin
    (exit 1). Report a failure by raising :class:`~titan_core.errors.TitanError` (exit 1) or
    :class:`~titan_core.errors.UsageError` (exit 2): titan prints its message as one line. Any
    other exception from ``run`` is one line too, naming the command, its plugin and
    distribution and where it raised (exit 1). Example: ``titan hello NAME``::

        from titan_core import Command, hookimpl

        def configure(parser):
            parser.add_argument("name")

        def run(args):
            print(f"hello {args.name}")
            return 0

        @hookimpl
        def titan_commands():
            return [Command("hello", "say hello", configure, run)]
    """


@hookspec
def titan_run_options() -> list[RunOption]:
    """Return flags of ``titan run`` that run something else with the resolved config.

    Called when ``titan run`` builds its parser. When the flag is given, the recipe is resolved
    and validated as for training, then ``run(config, registry, args)`` is called instead.
    Example: ``titan run --recipe R --count-steps``::

        from titan_core import RunOption, hookimpl

        @hookimpl
        def titan_run_options():
            return [RunOption("count_steps", "--count-steps", "print training.steps",
                              lambda config, registry, args: print(config.training.steps) or 0)]
    """


@hookspec
def titan_config_sections() -> list[ConfigSection]:
    """Return config sections this plugin adds to titan's config.

    Called when a config is first built or printed. A section is an attrs class made with
    :func:`titan_core.config.section`; recipes read and set it as ``config.<name>.<field>``,
    ``--print-config`` shows it, and every field is validated when it is set. Example::

        from titan_core import ConfigSection, hookimpl
        from titan_core.config import field, non_negative, section

        @section
        class ZLoss:
            #: Weight of the z-loss term; 0 turns it off.
            weight: float = field(default=0.0, validator=non_negative)

        @hookimpl
        def titan_config_sections():
            return [ConfigSection("z_loss", ZLoss, "z-loss on the logits")]
    """


__all__ = [
    "hookimpl",
    "hookspec",
    "titan_callbacks",
    "titan_checkpointers",
    "titan_comm_backends",
    "titan_commands",
    "titan_config_sections",
    "titan_datasets",
    "titan_models",
    "titan_recipes",
    "titan_run_options",
    "titan_strategies",
]
