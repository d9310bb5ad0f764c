"""Exports in every format: round trips on tiny random drafts, each engine's names and fields, refusals, and
strict reading of corrupted exports."""

import dataclasses
import json

import pytest
import torch
from conftest import tiny_draft_config
from safetensors.torch import load_file, save_file

from wingspan.config import TargetIdentity
from wingspan.errors import ExportError
from wingspan.export import FORMATS, ExportSettings, detect_format, export_draft, load_any_draft, read_export
from wingspan.export.core import draft_logits
from wingspan.models.draft import Eagle3Draft

FP32 = ExportSettings(dtype="float32")
TARGET = TargetIdentity(
    "org/tiny-llama", model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=6, dtype="float32"
)


def tiny_draft(layers: int, injection: str = "first", draft_vocab_size: int = 40, **overrides) -> Eagle3Draft:
    fields = dict(
        vocab_size=97,
        draft_vocab_size=draft_vocab_size,
        num_hidden_layers=layers,
        embed_injection=injection,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        target=TARGET,
    )
    torch.manual_seed(layers)
    draft = Eagle3Draft(tiny_draft_config(**{**fields, **overrides}))
    for module in draft.modules():  # non-trivial norms, so a norm loaded into the wrong slot shows
        if hasattr(module, "eps"):
            module.weight.data.uniform_(0.5, 1.5)
    target_ids = torch.randperm(97)[:draft_vocab_size].sort().values
    if draft_vocab_size < 97:
        draft.d2t.copy_(target_ids - torch.arange(draft_vocab_size))
        draft.t2d[target_ids] = True
    else:
        draft.t2d.fill_(True)
    return draft


def export(draft, path, fmt="vllm", settings=FP32):
    return export_draft(draft, path, fmt, settings)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_round_trip_reproduces_logits(tmp_path, fmt, layers):
    draft = tiny_draft(layers)
    out = export(draft, tmp_path / fmt, fmt)
    assert detect_format(out).name == fmt
    loaded = read_export(out, draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded, seed=1), draft_logits(draft, seed=1), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    assert loaded.config.aux_layer_ids == [1, 2, 3] and loaded.config.num_hidden_layers == layers
    if fmt == "speculators":  # its verifier fields hold the name and the architectures of the target
        assert loaded.config.target == TargetIdentity("org/tiny-llama", architectures=["LlamaForCausalLM"])
    else:
        assert loaded.config == draft.config
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))


def test_vllm_layout_and_fields(tmp_path):
    out = export(tiny_draft(2), tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 2
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert config["norm_before_residual"] is False and config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["wingspan_target"]["model_type"] == "llama"
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.hidden_norm.weight" in names and "layers.1.hidden_norm.weight" not in names


@pytest.mark.parametrize("layers", [1, 3])
def test_parallel_draft_exports_its_mask_for_vllm_only(tmp_path, layers):
    draft = tiny_draft(layers, draft_mode="parallel", mask_token_id=96, num_parallel_tokens=4)
    out = export(draft, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 96 and "mask_token_id" not in config["eagle_config"]
    # the serve command (card) turns parallel drafting on, with the K it was trained for
    assert '"num_speculative_tokens": 4, "parallel_drafting": true}' in (out / "README.md").read_text()
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (3 * 32,)  # vLLM: [3 * target hidden], before fc
    loaded = read_export(out, draft.embed_tokens.weight)
    assert loaded.config == draft.config
    # the mask slots' logits (draft_logits of a parallel draft) are the draft's
    torch.testing.assert_close(draft_logits(loaded, seed=1), draft_logits(draft, seed=1), rtol=0, atol=0)
    assert not torch.equal(draft_logits(loaded, seed=1), draft_logits(tiny_draft(layers), seed=1))
    for fmt in ("speculators", "sglang"):
        with pytest.raises(ExportError, match=f"a parallel draft .* has no {fmt} layout here"):
            export(draft, tmp_path / fmt, fmt)


def test_speculators_layout_and_fields(tmp_path):
    draft = tiny_draft(2)
    settings = ExportSettings(dtype="float32", speculative_tokens=5)
    out = export(draft, tmp_path / "spec", "speculators", settings)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3DraftModel"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 97 and layer["num_hidden_layers"] == 2
    assert config["draft_vocab_size"] == 40 and config["target_hidden_size"] == 32
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is False
    assert set(load_file(str(out / "model.safetensors"))) == set(
        load_file(str(export(draft, tmp_path / "v") / "model.safetensors"))
    )


def test_speculators_verifier_is_what_the_engine_can_open(tmp_path, monkeypatch):
    monkeypatch.setenv("WINGSPAN_CACHE", str(tmp_path / "cache"))
    embedded = TargetIdentity("smollm2-135m-instruct", model_type="llama", architectures=["LlamaForCausalLM"])
    out = export(tiny_draft(1, target=embedded), tmp_path / "spec", "speculators")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(tmp_path / "cache" / "models" / "smollm2-135m-instruct")
    given = ExportSettings(dtype="float32", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    out = export(tiny_draft(1, target=embedded), tmp_path / "spec", "speculators", given)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ExportError, match="does not record its target: give it with --target"):
        export(tiny_draft(1, target=None), tmp_path / "spec2", "speculators")


def test_sglang_layout_names_and_aux_ids(tmp_path):
    draft = tiny_draft(3)
    out = export(draft, tmp_path / "sglang", "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # outputs of layers 0..2
    tensors = load_file(str(out / "model.safetensors"))
    assert not any(name.startswith("layers.0.") for name in tensors)
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], draft.layers[0].hidden_norm.weight)
    for n in (1, 2):  # SGLang normalises a later layer's input with its hidden_norm
        assert torch.equal(tensors[f"layers.{n}.hidden_norm.weight"], draft.layers[n].input_layernorm.weight)


def test_sglang_cannot_capture_the_embedding_output(tmp_path):
    with pytest.raises(ExportError, match="id 0 is the target's embedding output"):
        export(tiny_draft(1, aux_layer_ids=[0, 2, 3]), tmp_path / "sglang", "sglang")


def test_sglang_layout_without_later_hidden_norm_is_an_error(tmp_path):
    draft = tiny_draft(2)
    out = export(draft, tmp_path / "sglang", "sglang")
    corrupt(out, lambda t: t.pop("layers.1.hidden_norm.weight"))
    with pytest.raises(ExportError, match="layers.1.hidden_norm.weight is missing: SGLang normalises layer 1"):
        read_export(out, draft.embed_tokens.weight)


@pytest.mark.parametrize(("source", "to"), [("vllm", "sglang"), ("sglang", "speculators"), ("speculators", "vllm")])
def test_an_export_converts_to_another_format(tmp_path, source, to):
    draft = tiny_draft(2)
    first = export(draft, tmp_path / source, source, ExportSettings(dtype="float32", verifier="org/tiny-llama"))
    second = export(
        load_any_draft(first), tmp_path / to, to, ExportSettings(dtype="float32", verifier="org/tiny-llama")
    )
    loaded = read_export(second, draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded, seed=2), draft_logits(draft, seed=2), rtol=0, atol=0)


SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_scaled_rope_round_trips_and_reads_as_transformers_reads_it(tmp_path, scaling, fmt):
    from transformers import LlamaConfig

    draft = tiny_draft(2, rope_scaling=SCALINGS[scaling], max_position_embeddings=256)
    plain = tiny_draft(2, max_position_embeddings=256)
    out = export(draft, tmp_path / fmt, fmt)
    loaded = read_export(out, draft.embed_tokens.weight)
    assert loaded.config.rope_scaling == SCALINGS[scaling] and loaded.config.rope_theta == 50000.0
    torch.testing.assert_close(draft_logits(loaded, seed=1), draft_logits(draft, seed=1), rtol=0, atol=0)
    assert not torch.allclose(draft_logits(plain, seed=1, length=40), draft_logits(draft, seed=1, length=40))
    config = json.loads((out / "config.json").read_text())
    layer = LlamaConfig(**config.get("transformer_layer_config", config))  # what the engines' config loading reads
    assert layer.rope_parameters == {"rope_theta": 50000.0, **SCALINGS[scaling]}


def test_each_engine_refuses_the_families_it_serves_no_draft_for(tmp_path):
    gemma = TargetIdentity("google/gemma-3-270m", model_type="gemma3_text")
    for fmt in ("vllm", "speculators"):
        with pytest.raises(ExportError, match="vLLM 0.32.*serves no EAGLE-3 draft for Gemma3 targets"):
            export(tiny_draft(1, target=gemma), tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()
    export(tiny_draft(1, target=gemma), tmp_path / "sglang", "sglang")  # SGLang's Gemma3 captures aux states


def test_bf16_export_is_cast_and_close(tmp_path):
    draft = tiny_draft(2)
    out = export_draft(draft, tmp_path / "vllm")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.long
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = read_export(out, draft.embed_tokens.weight)
    expected = draft_logits(draft)
    assert ((draft_logits(loaded) - expected).norm() / expected.norm()).item() < 0.01


@pytest.mark.parametrize(("fmt", "left_out"), [("vllm", {"d2t"}), ("sglang", {"d2t"}), ("speculators", {"d2t", "t2d"})])
def test_full_vocab_writes_no_mapping(tmp_path, fmt, left_out):
    """With equal vocabularies vLLM builds no draft-to-target mapping (and rejects a d2t tensor), and
    speculators registers neither buffer."""
    draft = tiny_draft(2, draft_vocab_size=97)
    out = export(draft, tmp_path / fmt, fmt)
    assert not left_out & set(load_file(str(out / "model.safetensors")))
    loaded = read_export(out, draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded), draft_logits(draft), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_what_no_engine_computes_is_refused(tmp_path, fmt):
    with pytest.raises(ExportError, match="embed_injection='all'.*layers >= 1 read H, not 2H"):
        export(tiny_draft(2, injection="all"), tmp_path / fmt, fmt)
    with pytest.raises(ExportError, match="hidden_size=32 differs from target_hidden_size=48"):
        export(tiny_draft(1, target_hidden_size=48), tmp_path / fmt, fmt)
    draft = tiny_draft(1, draft_vocab_size=97)
    draft.d2t[0] = 5
    with pytest.raises(ExportError, match="d2t"):
        export(draft, tmp_path / fmt, fmt)
    draft = tiny_draft(1)
    draft.fc.weight.data[0, 0] = float("nan")
    with pytest.raises(ExportError, match="non-finite weights"):
        export(draft, tmp_path / fmt, fmt)
    assert not (tmp_path / fmt).exists()


def test_existing_directory_that_is_not_an_export_is_kept(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a draft export; refusing to replace it"):
        export(tiny_draft(1), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_reexport_replaces_an_earlier_export_of_any_format(tmp_path):
    export(tiny_draft(1), tmp_path / "out", "sglang")
    out = export(tiny_draft(2), tmp_path / "out", "vllm")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert detect_format(out).name == "vllm" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def corrupt(out, change) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("layers.1.mlp.down_proj.weight"), r"missing tensor\(s\) \['layers.1.mlp.down_proj.weight'\]"),
        (
            lambda t: t.update({"layers.1.hidden_norm.weight": torch.ones(32)}),
            r"unexpected tensor\(s\) \['layers.1.hidden_norm.weight'\]",
        ),
        (lambda t: t.update({"fc.weight": torch.zeros(32, 64)}), r"fc.weight has shape \[32, 64\], the config needs"),
        (lambda t: t.pop("t2d"), r"missing tensor\(s\) \['t2d'\]"),
    ],
    ids=["missing", "extra", "shape", "t2d"],
)
def test_corrupted_export_is_an_error_naming_the_key(tmp_path, change, message):
    draft = tiny_draft(2)
    out = export_draft(draft, tmp_path / "vllm")
    corrupt(out, change)
    with pytest.raises(ExportError, match=message):
        read_export(out, draft.embed_tokens.weight)


@pytest.mark.parametrize(
    ("fmt", "change", "message"),
    [
        ("vllm", {"norm_before_residual": True}, "norm_before_residual is set"),
        ("vllm", {"norm_before_fc": True}, "norm_before_fc is set"),
        ("sglang", {"fc_norm": True}, "fc_norm is set"),
        ("speculators", {"norm_output": True}, "norm_output is set"),
        ("speculators", {"norm_before_residual": None}, "norm_before_residual is absent, which vLLM reads as true"),
        ("speculators", {"speculators_model_type": "peagle"}, "only eagle3 drafts are read"),
    ],
)
def test_config_variant_we_do_not_compute_is_an_error(tmp_path, fmt, change, message):
    draft = tiny_draft(1)
    out = export(draft, tmp_path / fmt, fmt)
    config = json.loads((out / "config.json").read_text()) | change
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ExportError, match=message):
        read_export(out, draft.embed_tokens.weight)


def test_model_card_names_the_base_model_and_its_license(tmp_path):
    import yaml

    from wingspan.config import TargetIdentity

    def front_matter(out):
        return yaml.safe_load((out / "README.md").read_text().split("---")[1])

    embedded = tiny_draft(1, target=TargetIdentity("smollm2-135m-instruct", model_type="llama"))
    front = front_matter(export(embedded, tmp_path / "embedded"))
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    local = tmp_path / "my-target"
    local.mkdir()
    (local / "README.md").write_text("---\nlicense: mit\n---\n# a target\n")
    front = front_matter(export(tiny_draft(1, target=TargetIdentity(str(local), model_type="llama")), tmp_path / "l"))
    assert front["license"] == "mit" and "base_model" not in front
    hub = export(tiny_draft(1, target=TargetIdentity("org/model", model_type="llama")), tmp_path / "hub", "sglang")
    assert front_matter(hub)["base_model"] == "org/model"
    card = (hub / "README.md").read_text()
    assert "Not recorded with this export" in card  # no training run behind a draft built in memory
    assert f"--model org/model --speculative-algorithm EAGLE3 --speculative-draft-model-path {hub}" in card

    # Published: the card names the repository and the target's hub origin, not this machine's paths.
    published = dataclasses.replace(FP32, repo_id="me/smollm2-draft")
    card = (export(embedded, tmp_path / "published", settings=published) / "README.md").read_text()
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config" in card
    assert '"model": "me/smollm2-draft"' in card and str(tmp_path) not in card
    with pytest.raises(ExportError, match="repo_id: expected a hub repository id ORG/NAME, got 'my draft'"):
        dataclasses.replace(FP32, repo_id="my draft")


def test_model_card_lists_the_optional_loss_settings_only_when_on():
    from wingspan.config import TrainConfig, to_dict
    from wingspan.export.card import Provenance, training_section

    def recipe(**changes):
        run = to_dict(TrainConfig(data=["chat.jsonl"], **changes))
        (line,) = [line for line in training_section(Provenance(run_config=run)) if line.startswith("- recipe:")]
        return line

    plain = recipe()
    assert "`ttt_steps=" in plain and "learn_prompts" not in plain and "topk_loss_k" not in plain
    on = recipe(learn_prompts=True, topk_loss_weight=0.5, topk_loss_k=5)
    assert "`learn_prompts=True`" in on and "`topk_loss_weight=0.5`, `topk_loss_k=5`" in on
