"""STree's tree-masked scan and tree conv (seed 003). The public functions dispatch to a Triton kernel once
one exists; until then the pure-PyTorch reference serves every device."""
from ssmspec.ops.tree_scan.naive import tree_conv1d_ref, tree_scan_ref

tree_scan = tree_scan_ref
tree_conv1d = tree_conv1d_ref

__all__ = ["tree_conv1d", "tree_conv1d_ref", "tree_scan", "tree_scan_ref"]
