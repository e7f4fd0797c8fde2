import math

import pytest
import torch

from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.training.engine import build_optimizer
from mmcse.training.optimizers import ReleasedAdamW, make_optimizer
from tests.conftest import REPO


def transformers_adamw_steps(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, weight_decay: float,
                             betas=(0.9, 0.999), eps=1e-6) -> list[torch.Tensor]:
    """transformers 4.x src/transformers/optimization.py ``AdamW.step`` with ``correct_bias=True``, written out for one
    tensor in float64 (the class the MCSE, KDMCSE and DALR train_mix.py import): the weights after each step."""
    p, m, v, out = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), []
    for t, g in enumerate(grads, start=1):
        m = beta_mix(m, g, betas[0])
        v = beta_mix(v, g * g, betas[1])
        step_size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
        p = p - step_size * (m / (v.sqrt() + eps))
        p = p - lr * weight_decay * p  # decoupled decay, after the update
        out.append(p.clone())
    return out


def beta_mix(avg: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    return beta * avg + (1 - beta) * x


def _grads(n: int, shape=(3, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # gradients whose scale varies over steps, some entries near zero: where ε's place matters
    return [torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (-(t % 4)) for t in range(n)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
def test_released_adamw_is_transformers_adamw(weight_decay, tensor_lr):
    p0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = _grads(12)
    param = torch.nn.Parameter(p0.clone())
    lr = 1e-2
    rate = torch.tensor(lr, dtype=torch.float64) if tensor_lr else lr
    optimizer = ReleasedAdamW([{"params": [param], "weight_decay": weight_decay}], lr=rate)
    want = transformers_adamw_steps(p0, grads, lr, weight_decay)
    for step, grad in enumerate(grads):
        param.grad = grad.clone()
        optimizer.step()
        torch.testing.assert_close(param.detach(), want[step], rtol=1e-12, atol=1e-14, msg=f"step {step + 1}")


def test_released_adamw_differs_from_pytorchs_where_the_papers_code_does():
    """ε 1e-6 before the bias correction against PyTorch's 1e-8 after it: the first steps on small gradients differ
    (the bias-corrected √v of a 1e-4 gradient is 1e-4, so ε is 1 % of it in transformers' AdamW)."""
    p0 = torch.zeros(4, dtype=torch.float64)
    grads = [torch.full((4,), 1e-4, dtype=torch.float64)] * 3
    ours = torch.nn.Parameter(p0.clone())
    theirs = torch.nn.Parameter(p0.clone())
    released, pytorch = ReleasedAdamW([ours], lr=1e-3), torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.0)
    for grad in grads:
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        released.step()
        pytorch.step()
    assert not torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.detach(), transformers_adamw_steps(p0, grads, 1e-3, 0.0)[-1])


def test_released_adamw_resumes_from_its_state_dict_to_the_same_weights():
    grads = _grads(8)
    p0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    whole = torch.nn.Parameter(p0.clone())
    first = ReleasedAdamW([whole], lr=1e-2)
    for grad in grads:
        whole.grad = grad.clone()
        first.step()
    part = torch.nn.Parameter(p0.clone())
    before = ReleasedAdamW([part], lr=1e-2)
    for grad in grads[:4]:
        part.grad = grad.clone()
        before.step()
    resumed_param = torch.nn.Parameter(part.detach().clone())
    resumed = ReleasedAdamW([resumed_param], lr=1e-2)
    resumed.load_state_dict(before.state_dict())
    for grad in grads[4:]:
        resumed_param.grad = grad.clone()
        resumed.step()
    assert torch.equal(resumed_param, whole)


def test_train_optimizer_picks_the_optimizer_and_an_unknown_one_is_named():
    cfg = load_config(REPO / "params.yaml", overrides={"ablate.preset": "none"})
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer, _ = build_optimizer(model, cfg.train, 10)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["eps"] == 1e-8
    optimizer, _ = build_optimizer(model, with_overrides(cfg, {"train.optimizer": "transformers_adamw"}).train, 10)
    assert type(optimizer) is ReleasedAdamW and optimizer.defaults["eps"] == 1e-6
    # no decay on biases and LayerNorm in either (train_mix.py l.317–327 names the same parameters)
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 3]
    with pytest.raises(ValueError, match="adamw, transformers_adamw"):
        make_optimizer("sgd", [{"params": list(model.parameters())}], 1e-3, fused=False)
