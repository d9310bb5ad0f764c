"""vLLM export: round trip on tiny random drafts, refusals, and strict reading of corrupted exports."""

import json

import pytest
import torch
from conftest import tiny_draft_config
from safetensors.torch import load_file, save_file

from wingspan.errors import ExportError
from wingspan.export.vllm import draft_logits, export_vllm, load_vllm_export
from wingspan.models.draft import Eagle3Draft


def tiny_draft(layers: int, injection: str = "first", draft_vocab_size: int = 40, **overrides) -> Eagle3Draft:
    fields = dict(
        vocab_size=97,
        draft_vocab_size=draft_vocab_size,
        num_hidden_layers=layers,
        embed_injection=injection,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        target_model_type="llama",
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


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_round_trip_reproduces_logits(tmp_path, layers):
    draft = tiny_draft(layers)
    out = export_vllm(draft, tmp_path / "vllm", dtype="float32")
    loaded = load_vllm_export(out, draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded, seed=1), draft_logits(draft, seed=1), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == layers and config["rope_parameters"]["rope_theta"] == 50000.0
    assert config["target_model_type"] == "llama"
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))


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


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_scaled_rope_round_trips_and_reads_as_transformers_reads_it(tmp_path, scaling):
    from transformers import LlamaConfig

    draft = tiny_draft(2, rope_scaling=SCALINGS[scaling], max_position_embeddings=256)
    plain = tiny_draft(2, max_position_embeddings=256)
    out = export_vllm(draft, tmp_path / "vllm", dtype="float32")
    loaded = load_vllm_export(out, draft.embed_tokens.weight)
    assert loaded.config.rope_scaling == SCALINGS[scaling] and loaded.config.rope_theta == 50000.0
    torch.testing.assert_close(draft_logits(loaded, seed=1), draft_logits(draft, seed=1), rtol=0, atol=0)
    assert not torch.allclose(draft_logits(plain, seed=1, length=40), draft_logits(draft, seed=1, length=40))
    config = LlamaConfig.from_pretrained(out)  # what vLLM's config loading starts from
    assert config.rope_parameters == {"rope_theta": 50000.0, **SCALINGS[scaling]}


def test_a_target_vllm_cannot_serve_drafts_for_is_refused(tmp_path):
    draft = tiny_draft(1, target_model_type="gemma3_text")
    with pytest.raises(ExportError, match="vLLM 0.32 serves no EAGLE-3 draft for Gemma3 targets"):
        export_vllm(draft, tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_bf16_export_is_cast_and_close(tmp_path):
    draft = tiny_draft(2)
    out = export_vllm(draft, tmp_path / "vllm")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.long
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_vllm_export(out, draft.embed_tokens.weight)
    expected = draft_logits(draft)
    assert ((draft_logits(loaded) - expected).norm() / expected.norm()).item() < 0.01


def test_full_vocab_writes_no_d2t(tmp_path):
    """vLLM builds no draft-to-target mapping when the vocabularies are equal and rejects a d2t tensor."""
    draft = tiny_draft(2, draft_vocab_size=97)
    out = export_vllm(draft, tmp_path / "vllm", dtype="float32")
    assert "d2t" not in load_file(str(out / "model.safetensors"))
    loaded = load_vllm_export(out, draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded), draft_logits(draft), rtol=0, atol=0)


def test_embed_injection_all_is_refused(tmp_path):
    with pytest.raises(ExportError, match="embed_injection='all'.*layers >= 1 read H, not 2H"):
        export_vllm(tiny_draft(2, injection="all"), tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_draft_hidden_size_other_than_target_is_refused(tmp_path):
    with pytest.raises(ExportError, match="hidden_size=32 differs from target_hidden_size=48"):
        export_vllm(tiny_draft(1, target_hidden_size=48), tmp_path / "vllm")


def test_nonidentity_mapping_over_full_vocab_is_refused(tmp_path):
    draft = tiny_draft(1, draft_vocab_size=97)
    draft.d2t[0] = 5
    with pytest.raises(ExportError, match="d2t"):
        export_vllm(draft, tmp_path / "vllm")


def test_existing_directory_that_is_not_an_export_is_kept(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a vLLM draft export"):
        export_vllm(tiny_draft(1), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_reexport_replaces_an_earlier_export(tmp_path):
    export_vllm(tiny_draft(1), tmp_path / "vllm")
    out = export_vllm(tiny_draft(2), tmp_path / "vllm")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm"]


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
    out = export_vllm(draft, tmp_path / "vllm")
    corrupt(out, change)
    with pytest.raises(ExportError, match=message):
        load_vllm_export(out, draft.embed_tokens.weight)


def test_config_variant_we_do_not_compute_is_an_error(tmp_path):
    draft = tiny_draft(1)
    out = export_vllm(draft, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"norm_before_residual": True}))
    with pytest.raises(ExportError, match="norm_before_residual is set"):
        load_vllm_export(out, draft.embed_tokens.weight)
