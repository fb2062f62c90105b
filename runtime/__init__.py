"""mlcc.runtime"""
