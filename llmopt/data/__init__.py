"""llmopt.data"""
