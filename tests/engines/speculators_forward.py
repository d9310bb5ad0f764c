"""Run in the referee venv: load a speculators export with speculators' own classes, strictly, and write the
logits of its TTT forward (document 0, positions from 0) over given features and tokens.

usage: python speculators_forward.py EXPORT_DIR INPUTS.safetensors OUT.safetensors STEPS
INPUTS holds aux_hidden [1, T, A*H], input_ids [1, T] (the token after each position, as speculators pairs
them), embed_tokens [V, H] (the target's); OUT gets logits_{j} [1, T, draft_vocab] for each TTT step j.
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

export_dir, inputs_path, out_path, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"  # dense masks on the CPU (no flex attention)
model = Eagle3DraftModel.from_pretrained(export_dir, config=config)
# Strictly: every tensor of the file is one the model declares, of its shape, and loaded by from_pretrained;
# every declared one is in the file, except those the model itself takes from the verifier.
state, declared = load_file(f"{export_dir}/model.safetensors"), model.state_dict()
missing = sorted(set(declared) - set(state) - set(Eagle3DraftModel._keys_to_ignore_on_load_missing))
unexpected = sorted(set(state) - set(declared))
if missing or unexpected:
    sys.exit(f"speculators declares other tensors: missing {missing}, unexpected {unexpected}")
not_loaded = sorted(k for k, v in state.items() if not torch.equal(declared[k].to(v.dtype), v))
if not_loaded:
    sys.exit(f"speculators' from_pretrained did not load {not_loaded}")
inputs = load_file(inputs_path)
model = model.float().eval()
model.embed_tokens.weight.data.copy_(inputs["embed_tokens"])
captured = []
model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach().clone()))
length = inputs["input_ids"].shape[1]
with torch.no_grad():
    model(
        hidden_states=inputs["aux_hidden"],
        input_ids=inputs["input_ids"],
        document_ids=torch.zeros(1, length, dtype=torch.long),
        position_ids=torch.arange(length)[None],
        ttt_steps=steps,
    )
save_file({f"logits_{j}": logits.contiguous() for j, logits in enumerate(captured)}, out_path)
print(f"loaded {len(state)} tensors strictly; {len(captured)} steps")
