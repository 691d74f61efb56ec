"""Experiments that run commpress for real and compare it with the model.

:mod:`commpress.experiments.validation` is ``commpress validate``: it trains the demo GPT on
the emulated cluster, measures iteration times and checks :mod:`commpress.perfmodel` against
them. It sits above :mod:`commpress.demo`, :mod:`commpress.cluster` and
:mod:`commpress.perfmodel` (see docs/architecture.md, "Layers"), so the model itself stays a
pure model that imports neither.
"""
