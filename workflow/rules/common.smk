# Helpers that turn a dvc.yaml stage into a Snakemake rule's input, output, params and shell.
import re
from pathlib import Path

import yaml

DVC_STAGES = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
PRODUCED = {
    (next(iter(out)) if isinstance(out, dict) else out)
    for stage in DVC_STAGES.values()
    for out in stage.get("outs", [])
}


def _resolve(text):
    """Replace dvc.yaml's ${section.key} templates with values from params.yaml."""

    def value(match):
        node = config
        for part in match.group(1).split("."):
            node = node[part]
        return str(node)

    return re.sub(r"\$\{([^}]+)\}", value, text)


def _name(path):
    return re.sub(r"\W", "_", path)


def stage_inputs(stage):
    """Named inputs: files as they are; a folder another stage writes stays a folder;
    any other folder (library code, the corpus) is expanded to its files, so that editing
    one of them re-runs the rule."""
    inputs = {}
    for dep in DVC_STAGES[stage]["deps"]:
        dep = _resolve(dep)
        path = Path(dep)
        if dep in PRODUCED or not path.is_dir():
            inputs[_name(dep)] = dep
        else:
            for i, file in enumerate(sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)):
                inputs[_name(f"{dep}_{i}")] = str(file)
    return inputs


def stage_outputs(stage):
    """Named outputs; persisted outs (checkpoints) are left to the stage, never deleted."""
    outputs = {}
    for out in DVC_STAGES[stage]["outs"]:
        path, options = next(iter(out.items())) if isinstance(out, dict) else (out, {})
        if options.get("persist"):
            continue
        outputs[_name(path)] = directory(path) if not Path(path).suffix else path
    return outputs


def stage_params(stage):
    """The params.yaml sections and keys the stage declares, so a change re-runs it."""
    return {_name(key): config[key] for key in DVC_STAGES[stage]["params"]}


def stage_shell(stage):
    return _resolve(DVC_STAGES[stage]["cmd"]) + " > {log} 2>&1"
