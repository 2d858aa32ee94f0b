"""The benchmark stage's settings (config key `benchmark`, shared by every experiment; snaketune.benchmark.run):
which lm-evaluation-harness tasks, on how many examples and shots, on which models and GGUF files; how much loss
against the base the report flags, and whether that fails the run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from snaketune.config.choices import EXPORT_QUANTS, fail

BENCHMARK_MODELS = ("base", "sft", "dpo")
"""benchmark.models: the base model (scored once for the experiments that share it), the SFT and the DPO model."""
TASK_SETTINGS = ("limit", "num_fewshot")
"""What benchmark.task_settings may set per task (over the section's own values)."""
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""A task name is a file name of the outputs (results/benchmark/.../<task>.json)."""
AUTO_TASKS = {
    "builtin": (
        ("builtin_choice",),
        "the builtin data's own questions (builtin_choice): what it teaches, and what forgetting would lose; the "
        "evaluate stage already scores their exact answers",
    ),
    "own": (
        ("mmlu_dev",),
        "general knowledge (mmlu_dev: MMLU's dev questions, offline), which fine-tuning on your data should keep; "
        "the hub's tasks (e.g. benchmark.tasks: [arc_easy, hellaswag, ifeval]) need network",
    ),
}
"""benchmark.tasks: auto, by the data: (tasks, why), as the report says it."""


@dataclass(frozen=True)
class BenchmarkConfig:
    enabled: bool = True
    """Score the models on `tasks` with lm-evaluation-harness (rules benchmark_base, benchmark, benchmark_gguf)."""
    tasks: tuple[str, ...] | str = "auto"
    """Harness task names: this repository's local tasks (offline: builtin_choice, builtin_answer on the builtin
    dataset's questions; mmlu_dev, general knowledge) or the harness's own (arc_easy, hellaswag, ifeval, ...: their
    data comes from the hub); auto: the tasks that fit the data (AUTO_TASKS), resolved when the config loads."""

    limit: int | None = None
    """Examples per task (the first ones); null: all (the local tasks have 200)."""
    num_fewshot: int = 0
    """Examples shown before each question; with chat_template as earlier user/assistant turns."""
    task_settings: dict = field(default_factory=dict)
    """Per task, `limit` and `num_fewshot` over the values above, e.g. {arc_easy: {num_fewshot: 5}}."""
    models: tuple[str, ...] = BENCHMARK_MODELS
    """Which models: base, sft, dpo (dpo where the experiment's preference stage runs)."""
    quants: tuple[str, ...] = ("q4_k_m",)
    """GGUF types of the exported SFT and DPO models scored through llama.cpp's server: those of them that
    export.quants makes (none with export off). q4_k_m is what people deploy; add q8_0 to see where the loss
    starts."""
    chat_template: bool = True
    """Render every prompt with the model's chat template, as the harness does for chat models
    (--apply_chat_template; few-shot examples as earlier turns, --fewshot_as_multiturn)."""
    batch_size: int = 8
    """Sequences per forward pass of a transformers model."""
    max_length: int = 2048
    """Most tokens of a request (context + continuation; longer contexts lose their start); the server's context."""
    max_drop: float = 2.0
    """Percentage points of a task's score (a share: acc, exact_match, ...) the final model or one of its scored GGUF
    files may lose against the base model before the report flags the run: flagged where the change's whole 95%
    interval lies below -max_drop (beyond it and beyond the noise; snaketune.report.benchmark). 0: any loss
    beyond the noise."""
    fail_on_drop: bool = False
    """Fail the run when the report flags a drop beyond max_drop: rule benchmark_gate, after the report is
    written, exits 1 naming each drop."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str) and self.tasks != "auto":
            fail("benchmark.tasks", f"{self.tasks!r} must be a list of task names or auto")
        # With auto, the tasks any data could pick: a setting for one the data does not pick is kept for another.
        named = (
            sorted({t for tasks, _ in AUTO_TASKS.values() for t in tasks})
            if self.tasks == "auto"
            else self.tasks
        )
        if self.enabled and not named:
            fail("benchmark.tasks", "is empty; name at least one task or set benchmark.enabled: false")
        for t in named:
            if not TASK_NAME.match(t):
                fail("benchmark.tasks", f"{t!r} is not a task name (letters, digits, '_', '.', '-')")
        if len(set(named)) != len(named):
            fail("benchmark.tasks", f"{list(named)} names a task twice")
        self._check_settings("benchmark.", {"limit": self.limit, "num_fewshot": self.num_fewshot})
        for task, settings in self.task_settings.items():
            if task not in named:
                fail(f"benchmark.task_settings.{task}", f"not in benchmark.tasks ({', '.join(named)})")
            if not isinstance(settings, dict):
                fail(
                    f"benchmark.task_settings.{task}",
                    f"{settings!r} must be a mapping of {', '.join(TASK_SETTINGS)}",
                )
            for key in settings:
                if key not in TASK_SETTINGS:
                    fail(
                        f"benchmark.task_settings.{task}.{key}",
                        f"unknown key; allowed: {', '.join(TASK_SETTINGS)}",
                    )
            self._check_settings(f"benchmark.task_settings.{task}.", settings)
        for m in self.models:
            if m not in BENCHMARK_MODELS:
                fail("benchmark.models", f"{m!r} is not allowed; allowed: {', '.join(BENCHMARK_MODELS)}")
        for q in self.quants:
            if q not in EXPORT_QUANTS:
                fail("benchmark.quants", f"{q!r} is not allowed; allowed: {', '.join(EXPORT_QUANTS)}")
        if self.batch_size < 1:
            fail("benchmark.batch_size", f"{self.batch_size} must be >= 1")
        if self.max_length < 16:
            fail("benchmark.max_length", f"{self.max_length} must be >= 16")
        if isinstance(self.max_drop, bool) or not 0 <= self.max_drop <= 100:
            fail(
                "benchmark.max_drop", f"{self.max_drop!r} must be a number of percentage points from 0 to 100"
            )
        if self.fail_on_drop and not (self.enabled and "base" in self.models):
            # Drops are changes against the base model: without its scores there is nothing to fail on.
            fail(
                "benchmark.fail_on_drop",
                "true needs the benchmark stage with the base model (benchmark.enabled: true, base in "
                f"benchmark.models; got enabled: {str(self.enabled).lower()}, models: {list(self.models)})",
            )

    def task_names(self, builtin_data: bool) -> tuple[str, ...]:
        """The tasks that run: those named, or for `auto` those that fit the data (builtin or the user's own)."""
        return AUTO_TASKS["builtin" if builtin_data else "own"][0] if self.tasks == "auto" else self.tasks

    def tasks_reason(self, builtin_data: bool) -> str:
        """Why these tasks run, in words (the report's)."""
        if self.tasks != "auto":
            return "named in benchmark.tasks"
        return (
            f"benchmark.tasks auto, for {'the builtin' if builtin_data else 'your own'} data: "
            + AUTO_TASKS["builtin" if builtin_data else "own"][1]
        )

    @staticmethod
    def _check_settings(where: str, settings: dict) -> None:
        limit = settings.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            fail(f"{where}limit", f"{limit!r} must be an integer >= 1 or null (all examples)")
        shots = settings.get("num_fewshot", 0)
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            fail(f"{where}num_fewshot", f"{shots!r} must be an integer >= 0")

    def task_spec(self, task: str) -> dict:
        """What one task's scores depend on in this section (the rules add the task file's hash and the code): the
        same for every model and file, so that their examples pair up."""
        own = self.task_settings.get(task, {})
        shots = own.get("num_fewshot", self.num_fewshot)
        limit = own.get("limit", self.limit)
        return {
            "name": task,
            "limit": limit,
            "num_fewshot": shots,
            "chat_template": self.chat_template,
            "fewshot_as_multiturn": self.chat_template and shots > 0,
        }

    def scored_quants(self, export_enabled: bool, export_quants: tuple[str, ...]) -> list[str]:
        """The GGUF types scored: those of `quants` that the export stage makes (none when it is off)."""
        return [q for q in self.quants if export_enabled and q in export_quants] if self.enabled else []
