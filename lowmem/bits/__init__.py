"""A width per BN-ReLU unit: each unit's measured gradient error (sensitivity), the widths that
fit a byte budget (allocate), and the one `--bits auto` door (auto)."""
