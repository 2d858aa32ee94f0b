import _stage

from pathlib import Path

from snaketune.report import ExperimentFiles, ReportInputs, build_report


def main(smk):
    spec = dict(smk.params.spec)
    names = spec["experiments"]
    experiments = [
        ExperimentFiles(name, Path(summary), Path(metrics), Path(ev), Path(gen), Path(tok))
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
    )
    build_report(inputs, Path(smk.output.html).parent)


_stage.run(snakemake, main)
