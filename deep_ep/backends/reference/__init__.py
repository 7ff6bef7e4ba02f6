"""The reference backend: dispatch and combine with torch ops and torch.distributed collectives.

Its public names are re-exported as `deep_ep.reference`.
"""
