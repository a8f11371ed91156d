# Stage 6: the report, rendered from the JSON files earlier rules wrote.


rule report:
    input:
        unpack(report_inputs),
    output:
        html="report/r013.html",
    params:
        # The page shows the config's hash, so any config change re-renders it (cheap); what cluster
        # jobs ask the scheduler for is not part of the study.
        config={key: value for key, value in config.items() if key != "cluster"},
    log:
        "logs/report/report.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/report.py"
