"""llmopt.train"""
