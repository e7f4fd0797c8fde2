"""An epoch's batch order by kind, as arithmetic, with no tensor in sight, so a plan or an estimate knows a job's
steps and its share of image–caption batches without loading torch.

Two orders (``train.batch_order``), both "alternating" text-only and image–caption batches as the MCSE, KDMCSE and
DALR papers say:

- ``alternate`` (`alternation_schedule`): each full batch of the epoch once, one pair batch after every
  ``n_text // n_pair`` text batches, the text batches left over at the end.
- ``released`` (`released_schedule`): the authors' `train_mix.py` loop (uds-lsv/MCSE @ 3031426 src/train_mix.py
  l.334, l.367–385; duyngtr16061999/KDMCSE @ 33270bc l.389, l.422–427; Hekang001/DALR @ c53e1fc the same lines of
  its copy): ``n_text + n_pair`` steps an epoch, step ``s`` (counted from 0 in each epoch) a pair batch where
  ``s % (n_text // n_pair) == 0``, else a text batch; both loaders are endless streams (``inf_train_gen``) that go on
  from one epoch into the next, so the pairs are seen more than once an epoch when ``n_text < 2·n_pair`` (COCO with
  every caption: half of the steps) and the text stream never finishes the corpus in an epoch.

The loaders' lengths are mmcse's full batches (`full_batches`): the released DataLoaders keep each pass's last,
partial batch (``⌈N/B⌉``), which mmcse drops in both orders (one batch a pass; Wiki1M at B 64 divides evenly).
"""

from __future__ import annotations

TEXT, PAIR = "text", "pair"
ALTERNATE, RELEASED = "alternate", "released"
BATCH_ORDERS = (ALTERNATE, RELEASED)


def alternation_schedule(n_text: int, n_pair: int) -> list[str]:
    """One epoch's batch kinds under ``alternate``: after every ``n_text // n_pair`` text batches one pair batch.

    Text batches left over once the pair batches run out come at the end; with more
    pair than text batches (ratio 0) the kinds alternate until the text runs out.
    """
    if n_pair == 0:
        return [TEXT] * n_text
    ratio = max(n_text // n_pair, 1)
    schedule: list[str] = []
    text_left, pair_left = n_text, n_pair
    while text_left or pair_left:
        take = min(ratio, text_left)
        schedule += [TEXT] * take
        text_left -= take
        if pair_left:
            schedule.append(PAIR)
            pair_left -= 1
    return schedule


def released_schedule(n_text: int, n_pair: int) -> list[str]:
    """One epoch's batch kinds under ``released``, the authors' `train_mix.py` arithmetic: ``n_text + n_pair`` steps,
    step ``s`` a pair batch where ``s % (n_text // n_pair) == 0`` (the first step is one). With no pair batch,
    ``n_text`` text steps. The released loop divides by zero where there are more pair than text batches: refused."""
    if n_pair == 0:
        return [TEXT] * n_text
    every = n_text // n_pair  # train_mix.py's paired_sample_step
    if every == 0:
        raise ValueError(f"train.batch_order: released takes a pair batch every n_text // n_pair steps, which is 0 "
                         f"with {n_text} text and {n_pair} pair batches (the authors' loop divides by zero): use "
                         "train.batch_order: alternate, or a larger corpus")
    return [PAIR if step % every == 0 else TEXT for step in range(n_text + n_pair)]


def epoch_schedule(order: str, n_text: int, n_pair: int) -> list[str]:
    """One epoch's batch kinds under ``order`` (``train.batch_order``)."""
    if order == ALTERNATE:
        return alternation_schedule(n_text, n_pair)
    if order == RELEASED:
        return released_schedule(n_text, n_pair)
    raise ValueError(f"unknown train.batch_order {order!r}; orders: {', '.join(BATCH_ORDERS)}")


def full_batches(n_text_items: int, n_pair_items: int, batch_size: int) -> tuple[int, int]:
    """The full text and pair batches an epoch holds (the last, partial batch of each is dropped);
    a batch larger than both the corpus and the pairs is refused."""
    n_text, n_pair = n_text_items // batch_size, n_pair_items // batch_size
    if n_text + n_pair == 0:
        raise ValueError(
            f"train.batch_size={batch_size} exceeds both the corpus ({n_text_items}) and the pairs ({n_pair_items})"
        )
    return n_text, n_pair


def batches_per_epoch(n_text_items: int, n_pair_items: int, batch_size: int, order: str = ALTERNATE) -> int:
    """The optimizer steps of one epoch of `mmcse.training.batches.Batches` (one per batch of either kind)."""
    return len(epoch_schedule(order, *full_batches(n_text_items, n_pair_items, batch_size)))


def pair_share(n_text_items: int, n_pair_items: int, batch_size: int, order: str = ALTERNATE) -> float:
    """The share of an epoch's steps that are image–caption batches under ``order``."""
    schedule = epoch_schedule(order, *full_batches(n_text_items, n_pair_items, batch_size))
    return schedule.count(PAIR) / len(schedule) if schedule else 0.0
