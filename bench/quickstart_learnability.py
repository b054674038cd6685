"""Can GRPO teach the quickstart task to the tiny random-init model on a CPU, quickly?

A self-contained minimal GRPO loop (no trainer, no rollout server, no storage), to prove the
embedded default job (the quickstart) is a real learning run and to pick its
hyperparameters. Per step:

  sample P prompts -> HF generate, n samples each (temperature 1.0, top-p 1.0; the default
  top-k of 50 exceeds the 26-token vocabulary, so sampling is over the full vocabulary)
  -> verl's strict GSM8K score (inline below) -> GRPO advantages (r - mean_g) / (std_g + 1e-6)
  -> token-mean policy-gradient loss, one update per batch (so the PPO ratio is 1 and the
  clipped loss is plain PG) -> AdamW.

It builds the model with grpo_rollout.tiny and the data with grpo_rollout.quickstart_data
(written to parquet and read back), i.e. exactly what the quickstart job uses. Prints per-step
mean reward, accuracy, format rate and elapsed time, and a final greedy validation score.

    python bench/quickstart_learnability.py --seed 0            # the recorded runs
    python bench/quickstart_learnability.py --seed 0 --lr 0     # control: no learning

With ``--loss NAME`` the update is the trainer's own registered policy loss
(``grpo_trainer.algorithms.policy_loss``: vanilla, cispo, sapo, geo_mean, ...; parameters at the
spec's defaults, ``seq-mean-token-mean`` for the sequence losses, token-mean otherwise) over
``--mini-batches`` updates per step, so from the second update on the ratio to the rollout policy
is no longer 1 and the losses differ (issue 44's learning checks):

    python bench/quickstart_learnability.py --seed 0 --loss cispo --mini-batches 4
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from grpo_api.spec import SEQUENCE_LOSSES, PolicyLossConfig
from grpo_rollout.quickstart_data import FORMAT_SCORE, write_quickstart_dataset
from grpo_rollout.tiny import build_tiny_model
from grpo_trainer.algorithms import policy_loss


# --- verl's GSM8K rule (verl/utils/reward_score/gsm8k.py, strict), inline -------------------
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(solution: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    found = GSM8K_ANSWER.findall(solution[-300:])  # verl matches only the last 300 characters
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").replace("$", "")  # the last `#### ` wins
    return score if answer == ground_truth else format_score


def response_mask(resp: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first eos; 0 for the padding after it."""
    is_eos = (resp == eos_id).int()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return (~after_eos).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="model init, data and sampling seed")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step (data.trainBatchSize)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01, help="verl's actor.optim.weight_decay")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="verl's actor.grad_clip")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=3, help="data.maxResponseLength")
    ap.add_argument("--format-score", type=float, default=FORMAT_SCORE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=json.loads, default={}, help='Qwen3Config overrides, JSON, e.g. {"hidden_size": 128}')
    ap.add_argument("--val", type=int, default=64, help="validation prompts (greedy, at the end)")
    ap.add_argument("--loss", default=None, help="a registered policy loss (algorithm.policyLoss); default: plain PG")
    ap.add_argument("--mini-batches", type=int, default=1, help="with --loss: updates per step (batch / miniBatchSize)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # no "Loading weights" bars in the log
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:  # write, then load back, as the job does
        model_dir = build_tiny_model(f"{tmp}/model", seed=args.seed, **args.size)
        train_path, test_path = write_quickstart_dataset(f"{tmp}/data", n_val=args.val, seed=args.seed)
        train, test = pq.read_table(train_path).to_pylist(), pq.read_table(test_path).to_pylist()
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    # The trainer's optimizer (grpo_trainer.model.build_optimizer): AdamW, verl's defaults.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))
    print(f"model: {sum(p.numel() for p in model.parameters())} params, vocab {len(tok)}; "
          f"P={args.prompts} n={args.n} lr={args.lr} T={args.temperature} "
          f"max_new={args.max_new_tokens} format_score={args.format_score} seed={args.seed}", flush=True)

    def rollout(rows, n, greedy=False):
        texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = enc.input_ids.repeat_interleave(n, 0)
        mask = enc.attention_mask.repeat_interleave(n, 0)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                 do_sample=not greedy, temperature=args.temperature, top_p=1.0,
                                 eos_token_id=eos, pad_token_id=pad)
        resp = out[:, ids.shape[1]:]
        rmask = response_mask(resp, eos)
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        gts = [r["reward_model"]["ground_truth"] for r in rows for _ in range(n)]
        rewards = torch.tensor([gsm8k_score(t, g, args.format_score) for t, g in zip(texts, gts)])
        formatted = torch.tensor([bool(GSM8K_ANSWER.search(t)) for t in texts]).float()
        return ids, mask, resp, rmask, rewards, formatted, texts

    t0 = time.time()
    history = []
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train), (args.prompts,), generator=gen).tolist()
        model.eval()
        ids, mask, resp, rmask, rewards, formatted, texts = rollout([train[i] for i in idx], args.n)

        # GRPO: advantage = (r - group mean) / (group std + eps), one value for all tokens.
        g = rewards.view(args.prompts, args.n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)

        # Token-mean PG loss over the response tokens. One update per batch: ratio = 1, so
        # PPO's clipped loss reduces to -A * logp (its gradient), which is what we minimise.
        model.train()
        full = torch.cat([ids, resp], 1)
        full_mask = torch.cat([mask.float(), rmask], 1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0).long()  # left padding: positions start at 0

        def token_logp(rows):
            logits = model(input_ids=full[rows], attention_mask=full_mask[rows].long(), position_ids=pos[rows]).logits
            logits = logits[:, ids.shape[1] - 1:-1].float() / args.temperature
            return torch.log_softmax(logits, -1).gather(-1, resp[rows].unsqueeze(-1)).squeeze(-1)

        if args.loss is None:
            logp = token_logp(slice(None))
            loss = -(adv.unsqueeze(1) * logp * rmask).sum() / rmask.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
        else:
            with torch.no_grad():
                old = token_logp(slice(None))  # the rollout policy's log-probs: PPO's old policy
            mode = "seq-mean-token-mean" if args.loss in SEQUENCE_LOSSES else "token-mean"
            for rows in torch.randperm(len(adv), generator=gen).chunk(args.mini_batches):
                m = rmask[rows]
                loss, _ = policy_loss(args.loss, old[rows], token_logp(rows), adv[rows].unsqueeze(1) * m, m,
                                      loss_agg_mode=mode, config=PolicyLossConfig(dro_beta=0.1))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                opt.step()

        mean_r = rewards.mean().item()
        history.append(mean_r)
        print(f"step {step:3d}  reward {mean_r:.3f}  acc {(rewards == 1).float().mean():.3f}  "
              f"format {formatted.mean():.3f}  resp_len {rmask.sum(1).mean():.2f}  "
              f"elapsed {time.time() - t0:6.1f}s  e.g. {texts[0]!r}", flush=True)

    model.eval()
    val_rewards = rollout(test, 1, greedy=True)[4]
    elapsed = time.time() - t0
    first = next((i + 1 for i in range(len(history)) if statistics.mean(history[max(0, i - 4):i + 1]) >= 0.8), None)
    print(f"summary: seed {args.seed} lr {args.lr} loss {args.loss} x{args.mini_batches}: reward first step {history[0]:.3f}, "
          f"mean of first 5 {statistics.mean(history[:5]):.3f}, mean of last 5 {statistics.mean(history[-5:]):.3f}; "
          f"5-step mean >= 0.8 at step {first}; greedy val {val_rewards.mean():.3f}; "
          f"{elapsed:.1f}s total, {elapsed / args.steps:.2f}s/step", flush=True)


if __name__ == "__main__":
    main()
