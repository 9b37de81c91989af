"""The encode side (owners): where two bit arrays differ (``scan``), a tensor's changed set (``diff``) and a
pack's (``packdiff``), changed sets into signed frames (``encode``), and the committed baselines with a
transfer's pending set (``baseline``). Never imports :mod:`~dcr_ray.codec.decoding`."""
