"""mlcc.runtime.api"""
