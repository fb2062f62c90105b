"""mlcc.runtime.spec"""
