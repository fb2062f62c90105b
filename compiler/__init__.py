"""mlcc.compiler"""
