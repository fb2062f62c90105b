"""mlcc.runtime.serve"""
