# Stage 6: the report, rendered from the JSON files earlier rules wrote.


rule report:
    input:
        unpack(report_inputs),
    output:
        html="report/{run}/r013.html",
    params:
        # the study as the page shows it (labels and title included; operational keys are not)
        config=report_params(config),
    log:
        "logs/{run}/report/report.log",
    resources:
        **CPU_JOB,
        mem_mb=2000,
        runtime=10,
    script:
        "../scripts/report.py"
