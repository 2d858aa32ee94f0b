import _stage

from pathlib import Path

from snaketune.report.inputs import ExperimentFiles, ReportInputs
from snaketune.report.build import build_report


def main(smk):
    spec = dict(smk.params.spec)
    names = spec["experiments"]
    # The preference stages' files, for the experiments that ran them (in the order report_params names them).
    pref_names = spec["preference_experiments"]
    preference = {
        name: dict(
            dpo_summary=Path(summary),
            dpo_metrics=Path(metrics),
            reference=Path(reference),
            pairs=Path(pairs),
            preferences=Path(preferences),
        )
        for name, summary, metrics, reference, pairs, preferences in zip(
            pref_names,
            smk.input.dpo_summaries,
            smk.input.dpo_metrics,
            smk.input.references,
            smk.input.pairs,
            smk.input.preferences,
            strict=True,
        )
    }
    exports = {}
    for (name, model), path in zip(spec["exports"], smk.input.exports, strict=True):
        exports.setdefault(name, {})[model] = Path(path)
    experiments = [
        ExperimentFiles(
            name,
            Path(summary),
            Path(metrics),
            Path(ev),
            Path(gen),
            Path(tok),
            **preference.get(name, {}),
            exports=exports.get(name, {}),
        )
        for name, summary, metrics, ev, gen, tok in zip(
            names,
            smk.input.summaries,
            smk.input.metrics,
            smk.input.evals,
            smk.input.generations,
            smk.input.tokenized,
            strict=True,
        )
    ]
    inputs = ReportInputs(
        experiments=experiments,
        source=Path(smk.input.source),
        sha256sums=Path(smk.input.sha256sums),
        conversations=Path(smk.input.conversations),
        config=spec["config"],
        benchmarks=Path(spec["benchmarks"]),
        manifest=Path(smk.input.manifest),
        invocation=spec["invocation"],
        benchmark_results=[Path(p) for p in smk.input.benchmark],
        benchmark_bases=spec["benchmark_bases"],
    )
    build_report(inputs, Path(smk.output.html).parent)


_stage.run(snakemake, main)
