"""Self-tuning: the draft tree this machine, target, drafter and head decode fastest with (``spechead tune``).

``tune`` (load, measure or fall back; ``open_session`` attaches it to a session as the ``auto`` resolver),
``calibrate`` (the tuning pass), ``costs``, ``predict``, ``store`` (cache and key), ``result``, ``show``;
``measure`` and ``speedup`` are the primitives the benchmarks share.
"""
