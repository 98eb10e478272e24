"""loomrl.algorithms"""
