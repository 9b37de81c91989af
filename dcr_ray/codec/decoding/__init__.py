"""The decode side (engines): opening a frame (``header``), its checked sections and packs (``sections``,
``packread``), the validating reader that writes nothing (``decode``, data types in ``decoded``), the class
counts of the bits a receiver holds (``classcounts``), class-mode positions against the old bits
(``context``), the in-place writes (``apply``) and their rollback (``undo``). Never imports
:mod:`~dcr_ray.codec.encoding`."""
