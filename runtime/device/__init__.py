"""mlcc.runtime.device"""
