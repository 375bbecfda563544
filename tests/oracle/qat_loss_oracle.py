"""Reference for learnable_scale_qat's losses (plugins/qat/losses.h), in plain PyTorch.

Written from AngelSlim's DistillLoss as docs/qat.md states it, with torch.nn.functional's own
kl_div, cross_entropy and mse_loss, nothing shared with the C++ code. Seeded student and teacher
logits [B, T, V] and labels with -100 at some positions; for each loss type the total
lm_weight*lm + kd_weight*kd, its terms, the T=1 diagnostics and the gradient of the total with
respect to the student logits. One line per case:
  name loss_type topk temperature lm_weight kd_weight  student teacher labels  total lm kd fkl bkl grad
tensors as hex of their fp32 bytes (labels as int64), shapes B, T, V below; absent terms are "-".
"""
import struct

import torch
import torch.nn.functional as F

B, T, V = 2, 7, 50

# name, loss_type, loss_topk (0: from the name), temperature, lm_loss_weight, kd_loss_weight
CASES = [
    ("origin", "origin", 0, 1.0, 1.0, 1.0),
    ("kl", "kl", 0, 1.0, 1.0, 1.0),
    ("rkl", "rkl", 0, 1.0, 0.5, 2.0),
    ("mse", "mse", 0, 1.0, 1.0, 1.0),
    ("kd_t2", "kd", 0, 2.0, 1.0, 1.0),
    ("cakld", "cakld", 0, 1.0, 1.0, 1.0),
    ("cakld_kd_only", "cakld", 0, 1.0, 0.0, 1.0),
    ("kl_top_8", "kl_top_8", 0, 1.0, 1.0, 1.0),
    ("r_kl_top_5", "r_kl_top_5", 0, 1.0, 1.0, 1.0),
    ("kl_top_loss_topk", "kl_top", 12, 1.0, 0.0, 1.0),
    ("kl_top_capped", "kl_top_100", 0, 1.0, 1.0, 1.0),  # K > V: the whole vocabulary
]


def hexof(t, fmt="f"):
    values = t.detach().flatten().tolist()
    return struct.pack(f"<{len(values)}{fmt}", *values).hex()


def kl(log_p, log_q):
    """KL(P||Q) per row, through F.kl_div (input log Q, target log P)."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def top_k(loss_type, topk):
    if topk > 0:
        return topk
    suffix = loss_type.rsplit("_", 1)[-1]
    return int(suffix) if suffix.isdigit() else 1000


def losses(student, teacher, labels, loss_type, topk, temperature, lm_w, kd_w):
    s = student[:, :-1].reshape(-1, V)
    t = teacher[:, :-1].reshape(-1, V)
    y = labels[:, 1:].reshape(-1)
    keep = y != -100
    s, t, y = s[keep].float(), t[keep].float(), y[keep]
    out = {}
    total = torch.zeros(())
    if lm_w > 0:
        out["lm"] = F.cross_entropy(student[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1),
                                    ignore_index=-100)
        total = total + lm_w * out["lm"]
    if kd_w > 0 and loss_type != "origin":
        ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
        fkl, bkl = kl(lt, ls), kl(ls, lt)
        if loss_type == "kl":
            kd = fkl.mean()
        elif loss_type == "rkl":
            kd = bkl.mean()
        elif loss_type == "mse":
            kd = F.mse_loss(s, t)
        elif loss_type == "kd":
            kd = temperature ** 2 * kl(F.log_softmax(t / temperature, -1), F.log_softmax(s / temperature, -1)).mean()
        elif loss_type == "cakld":
            conf = F.softmax(t, -1)[torch.arange(len(y)), y]
            kd = (conf * bkl + (1 - conf) * fkl).mean()
        else:
            k = min(top_k(loss_type, topk), V)
            if loss_type.startswith("kl_top"):
                idx = t.topk(k, -1).indices
                kd = kl(F.log_softmax(t.gather(-1, idx), -1), F.log_softmax(s.gather(-1, idx), -1)).mean()
            else:
                idx = s.detach().topk(k, -1).indices
                kd = kl(F.log_softmax(s.gather(-1, idx), -1), F.log_softmax(t.gather(-1, idx), -1)).mean()
        out["kd"], out["fkl"], out["bkl"] = kd, fkl.mean(), bkl.mean()
        total = total + kd_w * kd
    out["total"] = total
    return out


def main():
    for index, (name, loss_type, topk, temperature, lm_w, kd_w) in enumerate(CASES):
        gen = torch.Generator().manual_seed(2000 + index)
        student = (torch.randn(B, T, V, generator=gen) * 3).requires_grad_(True)
        teacher = student.detach() + torch.randn(B, T, V, generator=gen)
        labels = torch.randint(0, V, (B, T), generator=gen)
        labels[0, 2] = labels[1, 5] = labels[1, 6] = -100
        out = losses(student, teacher, labels, loss_type, topk, temperature, lm_w, kd_w)
        out["total"].backward()
        term = lambda key: hexof(out[key].reshape(1)) if key in out else "-"
        print(" ".join([name, loss_type, str(topk), repr(temperature), repr(lm_w), repr(kd_w), hexof(student),
                        hexof(teacher), hexof(labels, "q"), term("total"), term("lm"), term("kd"), term("fkl"),
                        term("bkl"), hexof(student.grad)]))


if __name__ == "__main__":
    main()
