"""Our SGLang export against SGLang's own source (the sglang 0.5 wheel, installed without its dependencies in
the referee venv). SGLang's model classes need its kernels and server runtime, which do not run on this CPU,
so its code is read, not run: the parameter names its `LlamaForCausalLMEagle3` declares, the name mapping of
its `load_weights`, and the two facts of its math the export relies on (later layers normalise their input
with `hidden_norm`; aux id k captures the input of layer k + 1) come from the installed source files."""

import ast
import subprocess
from pathlib import Path

import pytest
from conftest import VLLM_PYTHON
from safetensors.torch import load_file
from test_export import export, tiny_draft


def sglang_source() -> Path | None:
    if not VLLM_PYTHON.exists():
        return None
    found = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
        capture_output=True,
        text=True,
    )
    return Path(found.stdout.strip()).parent / "srt" / "models" if found.returncode == 0 else None


MODELS = sglang_source()
pytestmark = pytest.mark.skipif(MODELS is None, reason=f"sglang is not installed in {VLLM_PYTHON} (`make vllm-venv`)")
# Modules whose parameter is one `weight` (SGLang's layers and torch's), and classes without parameters.
WEIGHTED = {"RMSNorm", "QKVParallelLinear", "ParallelLMHead", "VocabParallelEmbedding", "Linear", "RowParallelLinear"}
WEIGHTED |= {"MergedColumnParallelLinear"}


def classes() -> dict[str, list[ast.ClassDef]]:
    """Class name -> its definitions, llama_eagle3.py's first (it redefines LlamaDecoderLayer over llama.py's)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for file in ("llama_eagle3.py", "llama.py"):
        for node in ast.parse((MODELS / file).read_text()).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
    return found


def callee(node: ast.expr) -> str | None:
    """The class a module attribute is built from: Name(...), a.b.Name(...), or the element of a ModuleList."""
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "ModuleList" and node.args:
            inner = node.args[0]
            if isinstance(inner, (ast.ListComp, ast.GeneratorExp)):
                return "ModuleList:" + (callee(inner.elt) or "")
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return None


def init_assignments(definitions: list[ast.ClassDef]) -> dict[str, str]:
    """`self.a.b = Class(...)` in __init__, the redefinition's over its base's."""
    out: dict[str, str] = {}
    for definition in reversed(definitions):
        for item in definition.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                for node in ast.walk(item):
                    if isinstance(node, ast.Assign) and len(node.targets) == 1:
                        path = ast.unparse(node.targets[0])
                        if path.startswith("self.") and (made := callee(node.value)):
                            out[path.removeprefix("self.")] = made
    return out


def declared_parameters(layers: int) -> set[str]:
    """The parameter names of SGLang's LlamaForCausalLMEagle3 with `layers` decoder layers."""
    known = classes()

    def expand(class_name: str, prefix: str) -> set[str]:
        names = set()
        for path, made in init_assignments(known[class_name]).items():
            if made.startswith("ModuleList:"):
                element = made.removeprefix("ModuleList:")
                for i in range(layers if path == "layers" else 0):
                    names |= expand(element, f"{prefix}{path}.{i}.") if element in known else set()
            elif made in WEIGHTED:
                names.add(f"{prefix}{path}.weight")
            elif made in known:
                names |= expand(made, f"{prefix}{path}.")
        return names

    return expand("LlamaForCausalLMEagle3", "")


def load_weights_mapping() -> tuple[dict[str, str], list[tuple]]:
    """legacy_name_map and stacked_params_mapping, as literals in SGLang's load_weights."""
    method = next(
        item
        for item in classes()["LlamaForCausalLMEagle3"][0].body
        if isinstance(item, ast.FunctionDef) and item.name == "load_weights"
    )
    literals = {}
    for node in ast.walk(method):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                literals[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return literals["legacy_name_map"], literals["stacked_params_mapping"]


def sglang_parameter(name: str, declared: set[str]) -> str | None:
    """Where SGLang's load_weights puts a tensor of our export (None: skipped, as d2t and t2d are), following
    its code: legacy renames, then the stacked q/k/v and gate/up shards, then a `model.` prefix."""
    legacy, stacked = load_weights_mapping()
    for old, new in legacy.items():
        if old in name:
            name = name.replace(old, new)
    if "d2t" in name or "t2d" in name:
        return None
    for param_name, weight_name, _shard in stacked:
        if weight_name in name:
            name = name.replace(weight_name, param_name)
            break
    return name if name in declared else f"model.{name}"


@pytest.mark.parametrize("layers", [1, 3])
def test_every_exported_tensor_lands_on_a_parameter_sglang_declares(tmp_path, layers):
    declared = declared_parameters(layers)
    assert "model.layers.0.self_attn.qkv_proj.weight" in declared and "lm_head.weight" in declared
    tensors = load_file(str(export(tiny_draft(layers), tmp_path / "sglang", "sglang") / "model.safetensors"))
    landed = {sglang_parameter(name, declared) for name in tensors} - {None}
    assert landed <= declared, f"SGLang would skip, without a word: {sorted(landed - declared)}"
    # Everything it declares is written, except the embeddings (shared from the target by SGLang) and the
    # variants' norms a plain EAGLE-3 config does not build (input_norm: norm_before_fc; fc_norm.*).
    left = {n for n in declared - landed if not n.startswith(("model.input_norm", "model.fc_norm"))}
    assert left == {"model.embed_tokens.weight"}


def test_sglang_math_the_export_relies_on():
    eagle3 = ast.parse((MODELS / "llama_eagle3.py").read_text())
    layer = next(n for n in eagle3.body if isinstance(n, ast.ClassDef) and n.name == "LlamaDecoderLayer")
    forward = next(n for n in layer.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    branch = next(
        n for n in ast.walk(forward) if isinstance(n, ast.If) and ast.unparse(n.test) == "self.is_input_layer"
    )
    later = ast.unparse(ast.Module(body=branch.orelse, type_ignores=[]))
    assert "self.hidden_norm(" in later and "input_layernorm" not in later  # a later layer's input norm

    def reads(nodes, attr):
        return [n for node in nodes for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == attr]

    assert len(reads([forward], "input_layernorm")) == len(reads(branch.body, "input_layernorm")) == 1  # layer 0 only
    llama = ast.parse((MODELS / "llama.py").read_text())
    capture = next(
        n for n in ast.walk(llama) if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture"
    )
    assert "[val + 1 for val in layer_ids]" in ast.unparse(capture)  # its id k: the input of layer k + 1
