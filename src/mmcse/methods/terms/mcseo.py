"""MCSEO's object–phrase term (l_obj-phra, Eq. 7), weighted β (its function: `mmcse.methods.compute.mcseo`)."""

from __future__ import annotations

from mmcse.methods.terms.base import LossTerm, register

register(LossTerm(
    name="object", equation="MCSEO l_obj-phra (Eq. 7)", order=70, weight="loss.mcseo.beta",
    active=lambda o: o.method == "mcseo" and o.loss.mcseo.object_phrase,
    inputs=lambda o: {"phrases", "objects", "object_pair"}, reads=lambda o: {"loss.mcseo.temperature"},
    # a batch whose captions have no detected object–phrase pair has no term
    applies=lambda e: e.phrases is not None and e.phrases.shape[0] > 0,
))
