"""`clover campaign` without `cloverlm.cli`, for the GPU machine (run by device.sh, phase 2): the CLI
module imports the server's packages (fastapi, pydantic), which that machine does not have, while the
campaign itself needs only torch, transformers, peft and gguf. The same options and call as
`clover campaign` (campaign.add_arguments, run_from_args); prints the campaign's summary as JSON."""

import argparse
import json
import sys

from cloverlm.training.conversion.campaign import add_arguments, run_from_args

parser = argparse.ArgumentParser()
add_arguments(parser)
print(json.dumps(run_from_args(parser.parse_args())))
loaded = {name.split(".")[0] for name, module in sys.modules.items() if module is not None} - set(
    sys.stdlib_module_names
)
print(
    "third-party modules loaded:",
    " ".join(sorted(n for n in loaded if not n.startswith("_"))),
    file=sys.stderr,
)
