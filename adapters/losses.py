"""The trainer's objectives on a map's context cache (map_kv.py), each a differentiable loss of one batch of teacher
windows (teacher.py): attention matching (layer-local, no backprop through the model), KL to the teacher's next-token
distributions of the continuation, cross-entropy of the true continuation, KL to the teacher over its own answer
after an instruction (answer windows, answer_windows.py; see trainer.py), that KL with a hinge on the answer's greedy
decisions (decision), and the same KL over the student's own greedy answer (on-policy)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from kvbridge.adapters.answering import greedy
from kvbridge.adapters.fuser import FuserMaps
from kvbridge.adapters.map_kv import context_kv, project_window
from kvbridge.adapters.scoring import continuation_logits
from kvbridge.adapters.teacher import capture_attention
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment


class AttentionGeometry:
    """Per target layer: the attention scale and o_proj weight, read once from the model's own modules."""

    def __init__(self, target: LoadedModel):
        ids = torch.tensor([0, 1])
        with torch.no_grad(), capture_attention(target.model) as rec:
            target.model(input_ids=ids[None].to(target.device))
        layers = range(target.spec.num_layers)
        self.scaling = [float(rec[j][0].scaling) for j in layers]
        self.o_proj = torch.stack([rec[j][0].o_proj.weight.detach().float() for j in layers])  # [L_t, hid, H_q*D]


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geometry: AttentionGeometry,
                      first: int = 0) -> torch.Tensor:
    """q: [L_t, H_q, T_q, D] at positions first..T-1; k, v: [L_t, H_t, T, D] -> causal attention through
    o_proj: [L_t, T_q, hidden]."""
    lt, hq, t, d = q.shape
    mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(diagonal=first)  # [T_q, T]
    out = torch.stack([F.scaled_dot_product_attention(q[j:j + 1], k[j:j + 1], v[j:j + 1], attn_mask=mask,
                                                      scale=geometry.scaling[j], enable_gqa=True)[0]
                       for j in range(lt)])  # [L_t, H_q, T_q, D]
    out = out.transpose(1, 2).reshape(lt, t, hq * d)
    return torch.bmm(out, geometry.o_proj.transpose(1, 2))


def attention_loss(maps, start_kv, window: dict, target: LoadedModel, geometry: AttentionGeometry,
                   context_tokens: int, queries: str = "continuation") -> torch.Tensor:
    k_p, v_p = project_window(maps, start_kv, window["xk"], window["xv"], window["start_mask"], target, window["ids"])
    k_own, v_own = window["k"].float(), window["v"].float()
    t = k_own.shape[2]
    ctx = torch.zeros(t, dtype=torch.bool)
    ctx[1:1 + context_tokens] = True  # the positions a projected cache replaces (the start token is exact)
    m = ctx[None, None, :, None]
    k_mix, v_mix = torch.where(m, k_p, k_own), torch.where(m, v_p, v_own)
    first = 1 + context_tokens if queries == "continuation" else 1
    q = window["q"].float()  # [L_t, H_q, T or N, D]: every position's, or the continuation's (query_positions)
    if q.shape[2] == t:
        q = q[:, :, first:]
    elif q.shape[2] != t - first:
        raise ValueError(f"the teacher cache kept the queries of {q.shape[2]} positions (query_positions 'scored'): "
                         f"matching queries {queries!r} reads {t - first}; rebuild it with query_positions 'all'")
    # q: [L_t, H_q, T - first, D]; causal from position `first` on
    with torch.no_grad():
        own = attention_outputs(q, k_own, v_own, geometry, first)  # [L_t, T - first, hidden]
        power = own.pow(2).sum(-1).mean(-1)  # [L_t]
    got = attention_outputs(q, k_mix, v_mix, geometry, first)
    return ((got - own).pow(2).sum(-1).mean(-1) / power).mean()


def continuation_logp(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int,
                      exact: int = 0) -> torch.Tensor:
    """Log-probs [B, N-1, V] the target gives the continuation's next tokens over the map's context cache; with
    `exact` > 0 the cache holds start + the context's first C - exact tokens, and the last `exact` are prefilled
    with the continuation (selective recompute's setting)."""
    if not 0 <= exact < context_tokens:
        raise ValueError(f"exact must be in [0, {context_tokens}) context tokens, got {exact}")
    p = 1 + context_tokens - exact  # tokens in the map's cache
    segments = []
    for w in windows:
        own = (w["k"][:, :, :p], w["v"][:, :, :p]) if isinstance(maps, FuserMaps) else (None, None)
        k, v = context_kv(maps, start_kv, w["xk"][:, :p], w["xv"][:, :p], w["start_mask"][:p], target,
                          w["ids"][:p], *own)
        segments.append(KVSegment(kv=torch.stack((k, v), dim=1), token_ids=w["ids"][:p],
                                  positions=torch.arange(p), model=target.spec.identity, rotated=True))
    rest = torch.stack([w["ids"][p:] for w in windows])  # [B, exact + N]
    return continuation_logits(target, segments, rest)[:, exact:-1].float().log_softmax(-1)


def teacher_kl(student: torch.Tensor, teacher: torch.Tensor, teacher_idx: torch.Tensor | None = None
               ) -> torch.Tensor:
    """KL(teacher || student) per position, averaged over the positions. student: log-probs [..., V]; teacher:
    log-probs [..., V] over the whole vocabulary (teacher_idx None), or [..., k] of the vocabulary entries teacher_idx
    [..., k] (a teacher's top-k), renormalised over them."""
    if teacher_idx is not None:
        teacher = teacher.log_softmax(-1)
        student = student.gather(-1, teacher_idx.to(student.device))
    teacher = teacher.to(student.device)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def kl_loss(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int, exact: int = 0
            ) -> torch.Tensor:
    """KL(teacher top-k || student) per scored position, averaged over the batch's positions."""
    logp = continuation_logp(maps, start_kv, windows, target, context_tokens, exact)
    return teacher_kl(logp, torch.stack([w["top_logp"] for w in windows]),  # [B, N-1, k]
                      torch.stack([w["top_idx"] for w in windows]))


def ce_loss(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int, exact: int = 0
            ) -> torch.Tensor:
    """Cross-entropy of the true continuation tokens 1..N-1, averaged over the batch's positions."""
    logp = continuation_logp(maps, start_kv, windows, target, context_tokens, exact)
    truth = torch.stack([w["ids"][2 + context_tokens:] for w in windows]).to(logp.device)  # [B, N-1]
    return -logp.gather(-1, truth[..., None]).mean()


def answer_context(maps, start_kv, window: dict, target: LoadedModel) -> KVSegment:
    """The map's cache of an answer window's start + document (answer_windows.py), rotated KV at 0..C."""
    c = int(window["lengths"][0])
    p = 1 + c
    if isinstance(maps, FuserMaps):
        raise ValueError("answer windows keep none of the target's own KV, which a fuser adds to: the answer "
                         "objective trains projections")
    k, v = context_kv(maps, start_kv, window["xk"].float(), window["xv"].float(), window["start_mask"], target,
                      window["ids"][:p])
    return KVSegment(kv=torch.stack((k, v), dim=1), token_ids=window["ids"][:p], positions=torch.arange(p),
                     model=target.spec.identity, rotated=True)


def answer_logits(maps, start_kv, window: dict, target: LoadedModel, context: KVSegment | None = None
                  ) -> torch.Tensor:
    """Logits [A, V] the target gives the teacher's answer tokens (teacher-forced) when it reads the instruction and
    the answer over the map's cache of start + document (`context`, else answer_context's)."""
    c, q, a = window["lengths"].tolist()
    context = context if context is not None else answer_context(maps, start_kv, window, target)
    logits = continuation_logits(target, context, window["ids"][1 + c:])[0]  # [Q + A, V]
    return logits[q - 1:q - 1 + a]


def topk_kl(student: torch.Tensor, teacher: torch.Tensor, teacher_idx: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens and one more class, the rest of the vocabulary, per
    position, averaged over the positions: 0 exactly where the student gives the top-k tokens and the rest what the
    teacher does. student: log-probs [..., V]; teacher: log-probs [..., k] (over the whole vocabulary, not
    renormalised) of the tokens teacher_idx [..., k]. (teacher_kl renormalises the teacher over its top-k and scores
    the student's own log-probs there: its optimum puts every bit of mass on the top-k.)"""
    s = student.gather(-1, teacher_idx.to(student.device))  # [..., k]
    t = teacher.to(student.device)
    tiny = torch.finfo(s.dtype).tiny
    rest_t = (-t.exp().sum(-1)).log1p().clamp(min=math.log(tiny))  # [...]: log of the teacher's mass off its top-k
    rest_s = (-s.exp().sum(-1)).clamp(min=-1.0).log1p().clamp(min=math.log(tiny))
    return ((t.exp() * (t - s)).sum(-1) + rest_t.exp() * (rest_t - rest_s)).mean()


def answer_loss(maps, start_kv, windows: list[dict], target: LoadedModel, decision_weight: float = 0.0
                ) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k and the rest (topk_kl) at each window's answer positions,
    averaged over positions, plus decision_weight times the decision hinge (decision_hinge) over the same answer;
    averaged over windows (of any document lengths: one forward per window)."""
    total = 0.0
    for w in windows:
        logp = answer_logits(maps, start_kv, w, target).float().log_softmax(-1)
        total = total + topk_kl(logp, w["top_logp"], w["top_idx"])
        if decision_weight:
            total = total + decision_weight * decision_hinge(logp, w["top_logp"], w["top_idx"])
    return total / len(windows)


DECISION_CAP = 1.0  # nats: the most margin the decision hinge asks of the student at one position
DECISION_WEIGHT = 1.0  # the hinge beside the answer KL (both are nats a position)


def decision_hinge(student: torch.Tensor, teacher: torch.Tensor, teacher_idx: torch.Tensor,
                   cap: float = DECISION_CAP) -> torch.Tensor:
    """The greedy decisions of one teacher-forced answer that the student would not make as the teacher did. At
    answer position i (of A) the margin m of the teacher's top token over the best other one, in log-probs: the
    teacher's from its top-k (teacher [A, k] sorted, teacher_idx [A, k]), the student's over the whole vocabulary
    (student [A, V]); the hinge max(0, min(m_teacher, cap) - m_student), weighted by the answer tokens a divergence
    there would change (A - i), the weights summing to 1. 0 exactly where the student ranks every teacher token first
    by at least the teacher's own margin (or cap): then its greedy answer is the teacher's. What the KL weighs by
    probability mass, this weighs by what greedy decoding reads: the order of the top two, the first tokens most."""
    if teacher.shape[-1] < 2:
        raise ValueError("the decision hinge needs the teacher's top two tokens at each position")
    top = teacher_idx[:, 0].to(student.device)
    s_top = student.gather(-1, top[:, None])[:, 0]
    best = student.topk(2, -1)  # the best other token: the student's first, or its second where the first is `top`
    s_other = torch.where(best.indices[:, 0] == top, best.values[:, 1], best.values[:, 0])
    t = teacher.to(student.device)
    want = (t[:, 0] - t[:, 1]).clamp(max=cap)
    a = student.shape[0]
    weight = torch.arange(a, 0, -1, dtype=student.dtype, device=student.device)
    return (weight * (want - (s_top - s_other)).clamp(min=0)).sum() / weight.sum()


def decision_loss(maps, start_kv, windows: list[dict], target: LoadedModel, weight: float = DECISION_WEIGHT
                  ) -> torch.Tensor:
    """The `decision` objective: answer_loss with `weight` times the decision hinge: 0 exactly at the teacher."""
    return answer_loss(maps, start_kv, windows, target, weight)


def own_context(target: LoadedModel, window: dict) -> KVSegment:
    """The target's own KV of an answer window's start + document: the teacher of the on-policy objective."""
    c = int(window["lengths"][0])
    with torch.no_grad():
        return kvcache.extract(target.model, target.spec, window["ids"][:1 + c])


def onpolicy_loss(maps, start_kv, windows: list[dict], target: LoadedModel, max_new_tokens: int, stop: set[int],
                  topk: int, teacher: Callable[[dict], KVSegment] | None = None, mix: float = 0.5) -> torch.Tensor:
    """On-policy distillation (as GKD mixes it): for each window the student (the target over the map's cache of the
    document) answers the instruction greedily, one line of at most `max_new_tokens`; the teacher (`teacher(window)`'s
    cache, by default the target's own prefill of the document) scores that answer; the on-policy term is
    KL(teacher || student) over the teacher's top-k and the rest (topk_kl) at every position the student chose a
    token and the one after its last (where it stopped). The loss is `mix` of it and 1 - mix of the teacher-forced
    KL over the window's own (teacher's) answer (answer_loss's), which keeps the student on the teacher's path while
    the on-policy term trains where its own answers leave it. Averaged over windows."""
    if not 0 <= mix <= 1:
        raise ValueError(f"mix must be in [0, 1], got {mix}")
    teacher = teacher or (lambda w: own_context(target, w))
    total = 0.0
    for w in windows:
        c, q, a = w["lengths"].tolist()
        prompt = w["ids"][1 + c:1 + c + q]
        context = answer_context(maps, start_kv, w, target)
        term = 0.0
        if mix < 1:
            forced = answer_logits(maps, start_kv, w, target, context).float().log_softmax(-1)
            term = (1 - mix) * topk_kl(forced, w["top_logp"], w["top_idx"])
        if mix > 0:
            with torch.no_grad():
                said, _ = greedy(target, replace(context, kv=context.kv.detach()), prompt, max_new_tokens, stop,
                                 one_line=True)
                asked = torch.cat((prompt, torch.tensor(said, dtype=torch.int64)))
                top = continuation_logits(target, teacher(w), asked)[0, q - 1:].float().log_softmax(-1).topk(topk,
                                                                                                              -1)
            student = continuation_logits(target, context, asked)[0, q - 1:].float().log_softmax(-1)
            term = term + mix * topk_kl(student, top.values, top.indices)
        total = total + term
    return total / len(windows)
