"""Helpers around the library: FP8 casting, random routing and local multi-process launching.

Nothing here is needed by `ElasticBuffer` itself; the modules load torch only when imported.
"""
