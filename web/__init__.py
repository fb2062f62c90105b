"""mlcc.web"""
