{{/* Names and labels. */}}
{{- define "agl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "agl.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: (dict "root" $ "role" "runner"). */}}
{{- define "agl.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "agl.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The prefix of groups and transactional ids: the topic prefix less its dot. */}}
{{- define "agl.groupPrefix" -}}
{{- trimSuffix "." .Values.topicPrefix | default "agl" -}}
{{- end -}}

{{- define "agl.strimziNamespace" -}}
{{- .Values.kafka.strimzi.namespace | default .Release.Namespace -}}
{{- end -}}

{{- define "agl.bootstrapServers" -}}
{{- if .Values.kafka.strimzi.enabled -}}
{{- printf "%s-kafka-bootstrap.%s.svc:%v" .Values.kafka.strimzi.cluster (include "agl.strimziNamespace" .) .Values.kafka.strimzi.bootstrapPort -}}
{{- else -}}
{{- required "kafka.bootstrapServers (host:port,...) or kafka.strimzi.enabled is needed" .Values.kafka.bootstrapServers -}}
{{- end -}}
{{- end -}}

{{- define "agl.securityProtocol" -}}
{{- if .Values.kafka.strimzi.enabled }}SASL_SSL{{ else }}{{ .Values.kafka.securityProtocol }}{{ end -}}
{{- end -}}

{{- define "agl.saslMechanism" -}}
{{- if .Values.kafka.strimzi.enabled }}SCRAM-SHA-512{{ else }}{{ .Values.kafka.saslMechanism }}{{ end -}}
{{- end -}}

{{- define "agl.saslUsername" -}}
{{- if .Values.kafka.strimzi.enabled }}{{ .Values.kafka.strimzi.user }}{{ else }}{{ .Values.kafka.username }}{{ end -}}
{{- end -}}

{{/* Where the SASL password is: a Secret name and key, or nothing. */}}
{{- define "agl.kafkaPasswordRef" -}}
{{- if .Values.kafka.strimzi.enabled -}}
name: {{ .Values.kafka.strimzi.user }}
key: password
{{- else if .Values.kafka.passwordSecret.name -}}
name: {{ .Values.kafka.passwordSecret.name }}
key: {{ .Values.kafka.passwordSecret.key }}
{{- else if .Values.kafka.password -}}
name: {{ include "agl.fullname" . }}-secrets
key: kafka-password
{{- end -}}
{{- end -}}

{{/* The brokers' CA: a Secret name and key, or nothing. */}}
{{- define "agl.kafkaCaRef" -}}
{{- if .Values.kafka.strimzi.enabled -}}
name: {{ .Values.kafka.strimzi.cluster }}-cluster-ca-cert
key: ca.crt
{{- else if .Values.kafka.caSecret.name -}}
name: {{ .Values.kafka.caSecret.name }}
key: {{ .Values.kafka.caSecret.key }}
{{- end -}}
{{- end -}}

{{- define "agl.postgresRef" -}}
{{- if .Values.postgres.cloudnativepg.enabled -}}
name: {{ .Values.postgres.cloudnativepg.cluster }}-app
key: uri
{{- else if .Values.postgres.uriSecret.name -}}
name: {{ .Values.postgres.uriSecret.name }}
key: {{ .Values.postgres.uriSecret.key }}
{{- else -}}
{{- $_ := required "postgres.uriSecret.name, postgres.uri or postgres.cloudnativepg.enabled is needed" .Values.postgres.uri -}}
name: {{ include "agl.fullname" . }}-secrets
key: postgres-uri
{{- end -}}
{{- end -}}

{{- define "agl.tokenRef" -}}
{{- if .Values.auth.tokenSecret.name -}}
name: {{ .Values.auth.tokenSecret.name }}
key: {{ .Values.auth.tokenSecret.key }}
{{- else if .Values.auth.token -}}
name: {{ include "agl.fullname" . }}-secrets
key: api-token
{{- end -}}
{{- end -}}

{{/* What every role but the dashboard needs: Kafka, metrics, redaction, the cache. */}}
{{- define "agl.env" -}}
- name: AGL_STREAM_BOOTSTRAP_SERVERS
  value: {{ include "agl.bootstrapServers" . | quote }}
- name: AGL_STREAM_TOPIC_PREFIX
  value: {{ .Values.topicPrefix | quote }}
- name: AGL_STREAM_REPLICATION_FACTOR
  value: {{ .Values.kafka.replicationFactor | quote }}
- name: AGL_STREAM_SECURITY_PROTOCOL
  value: {{ include "agl.securityProtocol" . | quote }}
{{- with include "agl.saslMechanism" . }}
- name: AGL_STREAM_SASL_MECHANISM
  value: {{ . | quote }}
- name: AGL_STREAM_SASL_USERNAME
  value: {{ include "agl.saslUsername" $ | quote }}
{{- end }}
{{- with include "agl.kafkaPasswordRef" . }}
- name: AGL_STREAM_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- if include "agl.kafkaCaRef" . }}
- name: AGL_STREAM_SSL_CAFILE
  value: /etc/agl-stream/kafka-ca/ca.crt
{{- end }}
- name: AGL_STREAM_METRICS_HOST
  value: "0.0.0.0"
- name: AGL_STREAM_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
{{- with .Values.redaction.keys }}
- name: AGL_STREAM_REDACT_KEYS
  value: {{ toJson . | quote }}
{{- end }}
{{- with .Values.redaction.patterns }}
- name: AGL_STREAM_REDACT_PATTERNS
  value: {{ toJson . | quote }}
{{- end }}
- name: AGL_STREAM_CHECKPOINT_CACHE
  value: /home/agl/.cache/agl-stream/checkpoints
- name: HOME
  value: /home/agl
{{- end -}}

{{/* PostgreSQL: the projector's, the dashboard's and the setup Job's only. */}}
{{- define "agl.postgresEnv" -}}
- name: AGL_STREAM_DATABASE_URL
  valueFrom:
    secretKeyRef:
      {{- include "agl.postgresRef" . | nindent 6 }}
{{- end -}}

{{/* The bearer token: what a server asks for (and a runner's gateway sends on). */}}
{{- define "agl.tokenEnv" -}}
{{- with include "agl.tokenRef" . }}
- name: AGL_STREAM_API_TOKEN
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "agl.upstreamTokenEnv" -}}
{{- with include "agl.tokenRef" . }}
- name: AGL_STREAM_UPSTREAM_TOKEN
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The object store's settings for boto3. */}}
{{- define "agl.s3Env" -}}
{{- with .Values.trainer.checkpoints.s3 }}
{{- if .enabled }}
{{- with .endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
- name: AWS_DEFAULT_REGION
  value: {{ .region | quote }}
{{- if .credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef: {name: {{ .credentialsSecret }}, key: AWS_ACCESS_KEY_ID}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ .credentialsSecret }}, key: AWS_SECRET_ACCESS_KEY}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Writable places under a read-only root, and the brokers' CA. */}}
{{- define "agl.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: cache, mountPath: /home/agl/.cache}
{{- if include "agl.kafkaCaRef" . }}
- {name: kafka-ca, mountPath: /etc/agl-stream/kafka-ca, readOnly: true}
{{- end }}
{{- end -}}

{{- define "agl.volumes" -}}
- {name: tmp, emptyDir: {}}
- {name: cache, emptyDir: {}}
{{- with include "agl.kafkaCaRef" . | fromYaml }}
- name: kafka-ca
  secret:
    secretName: {{ .name }}
    items: [{key: {{ .key | quote }}, path: ca.crt}]
{{- end }}
{{- end -}}

{{/* Whether the checkpoints are shared with runners and serve (a volume they can mount). */}}
{{- define "agl.sharedCheckpoints" -}}
{{- $p := .Values.trainer.checkpoints.persistence -}}
{{- if and .Values.trainer.enabled (not .Values.trainer.checkpoints.s3.enabled) (eq $p.accessMode "ReadWriteMany") -}}true{{- end -}}
{{- end -}}

{{- define "agl.checkpointClaim" -}}
{{- .Values.trainer.checkpoints.persistence.existingClaim | default (printf "%s-checkpoints" (include "agl.fullname" .)) -}}
{{- end -}}

{{/* A worker's probes: its metrics server answers /health (open even with a token) while it runs. */}}
{{- define "agl.metricsProbe" -}}
livenessProbe:
  httpGet: {path: /health, port: metrics}
  initialDelaySeconds: 30
  periodSeconds: 20
  failureThreshold: 6
{{- end -}}
