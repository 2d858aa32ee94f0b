import _stage

import sys
import time

from snaketune import provenance, verify


def main(smk):
    start = time.perf_counter()
    result = verify.verify(provenance.load_records(), smk.params.outputs, threads=smk.threads)
    seconds = time.perf_counter() - start
    lines = [
        f"verify: {result['checked']} outputs, {result['files']} files, {result['bytes'] / 1e9:.3f} GB hashed in "
        f"{seconds:.1f} s on {smk.threads} threads",
        *result["changed"],
        *(f"{out}: missing; the next plain run rebuilds it and what follows" for out in result["missing"]),
    ]
    for line in lines:
        print(line, file=sys.__stderr__)
        print(line, file=sys.stderr)  # the rule's log
    if result["changed"]:
        raise verify.OutputsChanged(
            f"{len(result['changed'])} outputs differ from their records (listed above)"
        )


_stage.run(snakemake, main, record=False)
