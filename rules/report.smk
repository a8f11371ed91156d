# Stage 6: the report, rendered from the JSON files earlier rules wrote.


rule report:
    input:
        unpack(report_inputs),
    output:
        html="report/r013.html",
    params:
        # The page shows the whole config's hash, so any config change re-renders it (cheap).
        config=config,
    log:
        "logs/report/report.log",
    resources:
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/report.py"
