"""The coding primitives, each both ways on plain arrays: positions (``locations``), positions in the class
order of the old values (``classorder``), ``ADD`` value differences (``intdiff``), byte planes
(``planes``), and the size estimates that pick an item's coding before anything is compressed
(``estimate``)."""
