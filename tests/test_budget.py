"""`wingspan quickstart --budget`: the duration parser, the sizing against known rates (exact figures), the plan
kept for a rerun, the options it refuses, and the probe on a tiny target."""

import dataclasses
import json
import math

import pytest
from test_synth import chatty  # noqa: F401

from wingspan.budget import (
    MARGIN,
    NO_PROMPTS,
    PLAN_FILE,
    Pace,
    Prompts,
    Rates,
    against_plan,
    by_the_target,
    fitted_passes,
    measure_rates,
    parse_budget,
    plan_sizes,
    predicted_seconds,
    probe_batches,
    save_plan,
    saved_plan,
    synthesized_per_batch,
)
from wingspan.config import TrainConfig
from wingspan.data.conversations import Conversation, Message
from wingspan.data.template import chat_prompt
from wingspan.errors import ConfigError
from wingspan.quickstart import (
    fit_training_to_budget,
    prompt_sample,
    run_quickstart,
    text_sample,
)

pytestmark = pytest.mark.usefixtures("one_thread")

REQUEST = dict(epochs=3.0, generate=True, prompts=[], prompt_share=None, text=["t.jsonl"], exclude=[])
# A conversation by the target: 1 s to write, 100 tokens; its features 1 s (100 tokens/s), 3 passes of training
# 1 s (300 tokens/s): 3 s in all. The closing measurement: 300 tokens at 10 a second, 30 s. A batch of answers to
# --prompts: 2 s, and 0.01 s a prompt token padded to its longest; 50 tokens of reply each.
RATES = Rates(
    invented_s=1.0,
    invented_tokens=100.0,
    answer_batch_s=2.0,
    answer_prompt_token_s=0.01,
    answer_reply_tokens=50.0,
    decode_tokens_per_s=10.0,
    dump_tokens_per_s=100.0,
    train_tokens_per_s=300.0,
)


@pytest.mark.parametrize(
    "text, seconds", [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("1.5h", 5400), ("45s", 45), (" 2h ", 7200)]
)
def test_durations(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "2 hours", "120", "h", "0m", "2h-5m"])
def test_a_duration_that_is_not_one_is_refused(text):
    with pytest.raises(ConfigError, match="--budget: expected a"):
        parse_budget(text)


def plan(budget_s, text_lengths, generate=True, so_far=70.0):
    return plan_sizes(budget_s, REQUEST | {"generate": generate}, RATES, text_lengths, 300, so_far)


def test_the_plan_takes_the_most_conversations_that_fit():
    # 70 s so far and 30 s of closing measurement; 950 s of the 1,000 (MARGIN) leave 850 s at 3 s a conversation
    assert MARGIN == 0.95
    fitted = plan(1000.0, [])
    assert (fitted.conversations, fitted.text_conversations, fitted.tokens) == (283, 0, 28300)
    assert fitted.predicted_total_s == pytest.approx(949.0)
    assert fitted.predicted_s["training"] == pytest.approx(283.0) and fitted.predicted_s["so far"] == 70.0
    assert sum(predicted_seconds(RATES, NO_PROMPTS, 284, 0, 3.0, 300, 70.0).values()) > 950


def test_text_is_drawn_in_the_recipe_proportion_until_it_runs_out():
    # 100 tokens of text cost 2 s (features and training): 4,500 of them for every 1,400 conversations
    fitted = plan(5000.0, [100] * 10_000)
    assert fitted.text_conversations == round(fitted.conversations * 4500 / 1400)
    total = fitted.predicted_total_s
    # one more conversation by the target and 3 or 4 of text would not fit
    assert total <= 4750 < total + 3 + 2 * 3 and fitted.conversations == 493
    # with 50 conversations of text, the rest of the budget goes to the target's own: (4750 - 100 - 100) / 3
    short = plan(5000.0, [100] * 50)
    assert (short.conversations, short.text_conversations) == (1516, 50)
    assert short.tokens == 1516 * 100 + 50 * 100


def test_text_only_takes_the_text_that_fits():
    fitted = plan(1000.0, [100] * 1000, generate=False)  # (950 - 100) / 2 s a conversation of text
    assert (fitted.conversations, fitted.text_conversations) == (0, 425)
    everything = plan(1000.0, [100] * 50, generate=False)
    assert (everything.conversations, everything.text_conversations) == (0, 50)


def test_the_dump_stops_where_the_disk_would_fill():
    fitted = plan_sizes(1000.0, REQUEST, RATES, [], 300, 70.0, max_tokens=10_050)
    assert (fitted.conversations, fitted.tokens) == (100, 10_000)
    with pytest.raises(ConfigError, match=r"--budget: no room on disk for the features of even one conversation"):
        plan_sizes(1000.0, REQUEST, RATES, [], 300, 70.0, max_tokens=50)


def test_a_budget_too_small_for_one_conversation_is_refused():
    with pytest.raises(ConfigError, match=r"--budget 1.67 min: too small on this machine; .* about 1\.72 min"):
        plan(100.0, [])


def test_a_run_reports_each_stage_beside_its_prediction():
    fitted = plan(1000.0, [])  # 283 conversations: 283 s each of writing, features and training
    spent = {"so far": 66.0, "the target's conversations": 141.0, "features": 300.0, "training": 283.0}
    assert against_plan(fitted, spent) == (
        "so far 1.1 min (predicted 1.2), the target's conversations 2.4 min (predicted 4.7), "
        "features 5.0 min (predicted 4.7), training 4.7 min (predicted 4.7)"
    )


def test_the_plan_is_kept_and_one_for_other_options_refused(tmp_path):
    fitted = plan(1000.0, [100] * 5)
    save_plan(fitted, tmp_path)
    assert saved_plan(tmp_path, 1000.0, json.loads(json.dumps(REQUEST))) == fitted
    assert saved_plan(tmp_path / "elsewhere", 1000.0, REQUEST) is None
    with pytest.raises(ConfigError, match=r"budget.json: the plan for --budget 16.7 min and \{'epochs': 3.0"):
        saved_plan(tmp_path, 1000.0, REQUEST | {"epochs": 2.0})
    with pytest.raises(ConfigError, match="its own --out"):
        saved_plan(tmp_path, 2000.0, REQUEST)
    (tmp_path / PLAN_FILE).write_text("{}")
    with pytest.raises(ConfigError, match=r"budget.json: not a budget plan .*remove it to measure again"):
        saved_plan(tmp_path, 1000.0, REQUEST)


def test_the_quickstart_refuses_sizes_beside_a_budget_before_it_loads_anything(tmp_path):
    out = tmp_path / "q"
    with pytest.raises(ConfigError, match="--budget: chooses --conversations and --text-conversations"):
        run_quickstart(out, device="cpu", budget="2h", conversations=100)
    with pytest.raises(ConfigError, match="--budget: chooses"):
        run_quickstart(out, device="cpu", budget="2h", text=("t.jsonl",), text_conversations=5)
    with pytest.raises(ConfigError, match="--conversations 0: needs --text"):
        run_quickstart(out, device="cpu", budget="2h", conversations=0)
    with pytest.raises(ConfigError, match="--budget: expected a duration"):
        run_quickstart(out, device="cpu", budget="two hours")
    out.mkdir()
    save_plan(dataclasses.replace(plan(1000.0, []), request=REQUEST | {"text": []}), out)
    with pytest.raises(ConfigError, match="budget.json: the plan for --budget 16.7 min"):
        run_quickstart(out, device="cpu", budget="2h")  # the saved plan was for 1,000 s
    assert sorted(p.name for p in out.iterdir()) == [PLAN_FILE]


def test_a_synthesis_batch_counts_the_conversations_it_keeps_not_those_asked_for(tmp_path):
    """32 asked, 24 kept from the first batch of 32 and the second cut at 8: two batches made 48 conversations'
    worth, not 32 (the probe would otherwise charge each conversation 1.5 times its time)."""
    messages = [Message("user", "hi"), Message("assistant", "hello")]
    made = [Conversation(messages, id=f"synth-7-0-{i}", source="s") for i in range(24)]
    made += [Conversation(messages, id=f"synth-7-1-{i}", source="s") for i in range(8)]
    assert synthesized_per_batch(made, 7, tmp_path / "s.jsonl") == 48
    assert synthesized_per_batch(made[:20], 7, tmp_path / "s.jsonl") == 20  # one batch: all it kept


def test_the_probe_times_a_typical_batch_and_the_longest_not_one_padded_at_random():
    """A regeneration batches prompts sorted by length, and drops those too long to answer; a batch drawn at random
    here would hold the one long prompt and be padded to it."""
    extra = [0, 1, 2, 3, 4, 5, 6, 7, 100]
    lengths = [10 + n for n in reversed(extra)]  # index 8 - k holds 10 + extra[k]
    index = {n: 8 - k for k, n in enumerate(extra)}
    # all fit: the mean is 14.2 tokens past the shortest; of the pairs in order, 6-7 (6.5) is nearest, 7-100 not
    typical, longest = probe_batches(Prompts(lengths, share=1.0, batch_size=2, longest=110))
    assert (typical, longest) == ([index[6], index[7]], [index[7], index[100]])
    # the long one is never answered: the mean of the 8 that fit is 3.5, the pair 3-4
    typical, longest = probe_batches(Prompts(lengths, share=1.0, batch_size=2, longest=17))
    assert (typical, longest) == ([index[3], index[4]], [index[6], index[7]])
    assert probe_batches(Prompts(lengths[:2], share=1.0, batch_size=3, longest=17)) == ([1], [1])
    assert probe_batches(Prompts(lengths[:1], share=1.0, batch_size=3, longest=17)) == ([], [])


def test_answers_are_charged_by_their_batches_padded_to_the_longest():
    """The first round(share x n) prompts drawn are answered, sorted into batches of 2, each padded to its longest;
    one too long (500) is dropped, costing nothing; invented conversations make up the rest."""
    prompts = Prompts([10, 30, 20, 500, 40], share=0.5, batch_size=2, longest=100)
    # 2 asked, [10, 30]: 2 s + 0.01 s x 2 rows x 30; 40 prompt tokens and 2 replies of 50; 2 invented
    assert by_the_target(RATES, prompts, 4) == pytest.approx((2.6 + 2.0, 140 + 200))
    # 4 asked, [10, 20] and [30] (500 dropped): 2.4 s + 2.3 s; 60 prompt tokens and 3 replies; 4 invented
    assert by_the_target(RATES, prompts, 8) == pytest.approx((4.7 + 4.0, 210 + 400))
    # all 5 asked (the files hold no more), [10, 20] and [30, 40]: 2.4 s + 2.8 s; 15 invented
    assert by_the_target(RATES, prompts, 20) == pytest.approx((5.2 + 15.0, 300 + 1500))
    assert by_the_target(RATES, NO_PROMPTS, 20) == (20.0, 2000.0)
    # the same budget buys fewer answers to long prompts than to short ones, each within it
    request = REQUEST | {"prompts": ["p.jsonl"], "prompt_share": 1.0}
    short, long = (
        plan_sizes(2000.0, request, RATES, [], 300, 70.0, prompts=Prompts([n] * 1000, 1.0, 32, 1000)) for n in (10, 900)
    )
    assert long.conversations < short.conversations
    assert max(short.predicted_total_s, long.predicted_total_s) <= MARGIN * 2000.0


def test_training_makes_the_passes_that_still_fit_the_budget(tmp_path, capsys):
    fitted = plan(1000.0, [])  # 283 conversations, 28,300 tokens; 636 s before training on the plan
    assert fitted_passes(fitted, 636.0, 28_300) == 3.0  # on time: the plan's passes (284 s left of 283)
    assert fitted_passes(fitted, 731.0, 28_300) == 2.0  # 95 s late: 189 s left, 56,700 tokens at 300 a second
    assert fitted_passes(fitted, 900.0, 28_300) == 1.0  # too late for one pass: one all the same
    assert fitted_passes(fitted, 400.0, 28_300) == 3.0  # early: never more than the plan's
    halved = dataclasses.replace(fitted, request=REQUEST | {"epochs": 0.5})
    assert fitted_passes(halved, 900.0, 28_300) == 0.5

    config = TrainConfig(data=["x.jsonl"], output_dir=str(tmp_path / "run"), epochs=3.0)
    assert fit_training_to_budget(fitted, config, tmp_path, 731.0, 28_300).epochs == 2.0
    assert capsys.readouterr().out == (
        "[3/5] training starts with 2 passes in place of 3: the stages before it took 1.6 min more than predicted\n"
    )
    kept = saved_plan(tmp_path, 1000.0, REQUEST)
    assert kept.training_passes == 2.0
    assert json.loads((tmp_path / "train_config.json").read_text())["epochs"] == 2.0
    # a rerun (this process spent less) resumes the same training
    assert fit_training_to_budget(kept, config, tmp_path, 100.0, 28_300).epochs == 2.0
    assert "as fitted to the budget when training first started" in capsys.readouterr().out


def test_training_s_end_follows_the_clock_at_its_recent_speed():
    clock = iter([50.0, 100.0, 200.0, 300.0, 400.0, 500.0, 1100.0])
    pace = Pace(deadline=1000.0, max_passes=3.0, clock=lambda: next(clock))
    assert pace(50, 200) is None  # no speed yet
    assert pace(100, 200) == 600  # 1 s a step: 900 more fit, but three passes are 600
    assert pace(150, 200) == 600  # 2 s a step from here; no call is 300 s old, so 1.5 s a step since step 50
    assert pace(200, 200) == 600  # 1.67 s a step since step 50: 420 more fit
    assert pace(250, 200) == 550  # 2 s a step since step 100, the last call at least 300 s old: 300 more fit
    assert pace(300, 200) == 550  # 2 s since step 150: 250 more in the 500 s left (the 1.8 since step 50: 277)
    assert pace(350, 200) == 350  # past the deadline after one pass: it ends now
    assert pace.summary() == "training's end fitted to the clock at 6 checkpoints, from step 600 to 350 (1.75 passes)"

    late = Pace(deadline=100.0, max_passes=3.0, clock=iter([0.0, 150.0]).__next__)
    late(50, 200)
    assert late(100, 200) == 200  # out of time before one pass: one all the same


def probe_config(tiny_llama_dir, tmp_path) -> TrainConfig:
    return TrainConfig(
        target=str(tiny_llama_dir),
        output_dir=str(tmp_path / "run"),
        target_dtype="float32",
        aux_layer_ids=[1, 2],
        num_hidden_layers=1,
        draft_vocab_size=64,
        max_length=64,
        batch_tokens=256,
        ttt_steps=2,
        lr=1e-3,
    )


def test_the_probe_times_every_stage_and_leaves_nothing_behind(chatty, tiny_llama_dir, counting_chat, tmp_path):  # noqa: F811
    config = probe_config(tiny_llama_dir, tmp_path)
    text = text_sample((str(counting_chat(12, spread=4)),), None, seed=0)
    lengths = [30] * len(text)
    synth = dict(batch_size=4, max_new_tokens=6)
    rates = measure_rates(chatty, config, tmp_path / "probe", synth, [], NO_PROMPTS, text, lengths)
    assert not (tmp_path / "probe").exists()
    for name, value in dataclasses.asdict(rates).items():
        if name.startswith("answer_"):  # no --prompts: none answered
            assert value == 0.0, name
        else:
            assert math.isfinite(value) and value > 0, name
    # a synthesized conversation: a user turn of at most 128 tokens, a reply of at most 6, and the template's own
    assert 6 < rates.invented_tokens <= 128 + 6 + 12


def test_the_probe_times_each_kind_of_conversation_the_run_will_have(
    chatty,  # noqa: F811
    tiny_llama_dir,
    counting_chat,
    tmp_path,
):
    """Answers to --prompts (two batches: 8 prompts, 4 a batch) when the run answers any, invented conversations
    when it invents any; answers are greedy and synthesis seeded, so each kind's tokens are the same in every
    probe."""
    config = probe_config(tiny_llama_dir, tmp_path)
    chats = (str(counting_chat(12, spread=4)),)
    prompts, text = prompt_sample(chats, 8, seed=0), text_sample(chats, None, seed=0)
    lengths = [len(chat_prompt(chatty.tokenizer, c.as_dicts())) for c in prompts]
    synth = dict(batch_size=4, max_new_tokens=6)
    rates = {}
    for share in (0.0, 0.5, 1.0):
        asked = Prompts(lengths, share, batch_size=4, longest=config.max_length - 6)
        rates[share] = measure_rates(chatty, config, tmp_path / "probe", synth, prompts, asked, text, [30] * 12)
    assert rates[0.0].answer_batch_s == rates[0.0].answer_reply_tokens == 0.0
    assert rates[1.0].invented_s == rates[1.0].invented_tokens == 0.0
    for timed in (rates[0.5], rates[1.0]):
        assert timed.answer_batch_s + 4 * max(lengths) * timed.answer_prompt_token_s > 0
        assert timed.answer_prompt_token_s >= 0 and math.isfinite(timed.answer_prompt_token_s)
    assert rates[0.5].answer_reply_tokens == rates[1.0].answer_reply_tokens
    assert 0 < rates[1.0].answer_reply_tokens <= 6 + 12  # a reply of at most 6, and the template's own
    assert rates[0.5].invented_tokens == rates[0.0].invented_tokens > 0
    too_long = [Conversation([Message("user", "Say" + " a" * 80)], id="long", source="s")]  # max_length 64
    asked = Prompts([len(chat_prompt(chatty.tokenizer, too_long[0].as_dicts()))], 1.0, 4, config.max_length - 6)
    with pytest.raises(ConfigError, match=r"--prompts: no prompt is short enough to answer \(at most 58 tokens"):
        measure_rates(chatty, config, tmp_path / "probe", synth, too_long, asked, text, [30] * 12)
    assert not (tmp_path / "probe").exists()
