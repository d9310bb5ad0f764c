"""`wingspan import`: every format we write comes back with identical logits, and the layouts we do not write
(the EAGLE repository's, SpecForge's multi-layer one) are built here from their own code's names (cited) and
read strictly."""

import json

import pytest
import torch
from safetensors.torch import save_file
from test_export import export, tiny_draft

from wingspan.errors import ExportError
from wingspan.export import FORMATS, ExportSettings
from wingspan.export.core import draft_logits
from wingspan.export.importers import import_draft
from wingspan.models.draft import Eagle3Draft


def same_logits(directory, draft) -> None:
    loaded = Eagle3Draft.load(directory, embed_weight=draft.embed_tokens.weight)
    torch.testing.assert_close(draft_logits(loaded, seed=3), draft_logits(draft, seed=3), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("layers", [1, 3])
def test_each_export_imports_with_identical_logits(tmp_path, fmt, layers):
    draft = tiny_draft(layers)
    layout, out = import_draft(export(draft, tmp_path / fmt, fmt), tmp_path / "draft")
    assert layout == fmt
    same_logits(out, draft)
    assert json.loads((out / "imported.json").read_text())["layout"] == fmt


def rename(state: dict, names: dict) -> dict:
    out = {}
    for name, tensor in state.items():
        for ours, theirs in names.items():
            if name.startswith(ours):
                name = theirs + name.removeprefix(ours)
                break
        out[name] = tensor.clone()
    return out


def eagle_repository_checkpoint(draft, directory) -> None:
    """SafeAILab/EAGLE's EAGLE-3 head as its training saves it: `eagle/model/cnets.py` (class Model) names the
    one layer `midlayer` (hidden_norm, input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
    mlp.{gate,up,down}_proj) beside fc, norm, lm_head, d2t, t2d; `eagle/traineagle3/config.json` is a flat
    LlamaConfig (architectures LlamaForCausalLM) without head_dim, RoPE or aux-layer fields; DeepSpeed's
    save_16bit_model writes pytorch_model.bin."""
    directory.mkdir()
    torch.save(rename(draft.trainable_state_dict(), {"layers.0.": "midlayer."}), directory / "pytorch_model.bin")
    config = draft.config
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": 1,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "max_position_embeddings": 2048,
                "rms_norm_eps": config.rms_norm_eps,
                "tie_word_embeddings": False,
                "vocab_size": config.vocab_size,
                "draft_vocab_size": config.draft_vocab_size,
                "torch_dtype": "float16",
            }
        )
    )


def test_the_eagle_repository_layout(tmp_path):
    draft = tiny_draft(1, rope_theta=10000.0, max_position_embeddings=2048, target=None)  # its defaults
    eagle_repository_checkpoint(draft, tmp_path / "eagle")
    with pytest.raises(ExportError, match="records no aux layer ids.*give --target .* or --aux-layer-ids"):
        import_draft(tmp_path / "eagle", tmp_path / "draft")
    layout, out = import_draft(tmp_path / "eagle", tmp_path / "draft", aux_layer_ids=[1, 2, 3])
    assert layout == "eagle"
    same_logits(out, draft)


def specforge_multilayer_checkpoint(draft, directory) -> None:
    """SpecForge's multi-layer draft (PR 401, branch llama3-mlp-for-draft-decoder, at d12fffb8:
    specforge/modeling/draft/llama3_eagle.py): layer 0 is `fuse_layer` (midlayer's names), layer i + 1 is
    `additional_layers.{i}` with `hidden_norm` as its input norm and no input_layernorm; aux ids in
    `eagle_config` are SGLang's (the output of layer k)."""
    state = rename(draft.trainable_state_dict(), {"layers.0.": "fuse_layer."})
    for n in range(1, draft.config.num_hidden_layers):
        layer = {k: state.pop(k) for k in list(state) if k.startswith(f"layers.{n}.")}
        for name, tensor in layer.items():
            name = name.replace("input_layernorm", "hidden_norm")
            state[f"additional_layers.{n - 1}." + name.removeprefix(f"layers.{n}.")] = tensor
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    config = draft.config
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "model_type": "llama",
                "num_hidden_layers": config.num_hidden_layers,
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "head_dim": config.head_dim,
                "max_position_embeddings": config.max_position_embeddings,
                "rms_norm_eps": config.rms_norm_eps,
                "rope_theta": config.rope_theta,
                "vocab_size": config.vocab_size,
                "draft_vocab_size": config.draft_vocab_size,
                "target_hidden_size": config.target_hidden_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in config.aux_layer_ids]},
            }
        )
    )


def test_the_specforge_multilayer_layout(tmp_path):
    draft = tiny_draft(3, target=None)
    specforge_multilayer_checkpoint(draft, tmp_path / "specforge")
    layout, out = import_draft(tmp_path / "specforge", tmp_path / "draft")
    assert layout == "specforge-multilayer"
    same_logits(out, draft)
    assert Eagle3Draft.load(out).config.aux_layer_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("additional_layers.1.mlp.up_proj.weight"), r"missing tensor\(s\) \['layers.2.mlp.up_proj"),
        (lambda s: s.update({"fuse_layer.extra.weight": torch.ones(3)}), r"unexpected tensor\(s\) \['layers.0.extra"),
        (lambda s: s.update({"fc.weight": torch.ones(32, 32)}), r"fc.weight has shape \[32, 32\], the config needs"),
        (lambda s: s.pop("additional_layers.0.hidden_norm.weight"), r"layers.1.hidden_norm.weight is missing"),
    ],
    ids=["missing", "unexpected", "shape", "later-norm"],
)
def test_a_checkpoint_that_does_not_fit_names_the_first_key(tmp_path, change, message):
    from safetensors.torch import load_file

    specforge_multilayer_checkpoint(tiny_draft(3, target=None), tmp_path / "specforge")
    state = load_file(str(tmp_path / "specforge" / "model.safetensors"))
    change(state)
    save_file(state, str(tmp_path / "specforge" / "model.safetensors"))
    with pytest.raises(ExportError, match=message):
        import_draft(tmp_path / "specforge", tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_an_imported_draft_exports_for_every_engine(tmp_path):
    draft = tiny_draft(2, target=None)
    specforge_multilayer_checkpoint(draft, tmp_path / "specforge")
    _, out = import_draft(tmp_path / "specforge", tmp_path / "draft", target="org/tiny-llama")
    imported = Eagle3Draft.load(out, embed_weight=draft.embed_tokens.weight)
    assert imported.config.target.name_or_path == "org/tiny-llama"
    for fmt in FORMATS:
        export(imported, tmp_path / fmt, fmt, ExportSettings(dtype="float32"))


def test_import_cli_errors_are_one_line(tmp_path):
    from test_cli import wingspan

    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "junk" / "model.safetensors"))
    result = wingspan("import", str(tmp_path / "junk"), "--out", str(tmp_path / "draft"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "an unknown layout" in result.stderr
