"""loomrl.train"""
