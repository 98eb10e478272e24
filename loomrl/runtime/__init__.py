"""loomrl.runtime"""
