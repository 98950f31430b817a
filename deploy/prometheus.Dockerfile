# Prometheus from Debian's package, for machines that cannot pull prom/prometheus (the container
# tier: scripts/container_images.sh prometheus builds it). Its build context holds this file and
# the package's .deb; only the server binary is kept, run as prom/prometheus runs it.
ARG BASE_IMAGE=debian:bookworm
FROM ${BASE_IMAGE}
COPY prometheus_*.deb /tmp/
RUN dpkg-deb -x /tmp/prometheus_*.deb /tmp/prometheus \
 && cp /tmp/prometheus/usr/bin/prometheus /bin/prometheus \
 && rm -rf /tmp/prometheus /tmp/prometheus_*.deb \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
