"""dcr_ray: delta-compressed, bit-exact refits for RL on Ray."""
